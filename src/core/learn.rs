//! PLACEHOLDER (wt-audit): the policy writer is wt-learncore's `core::learn`; this file only
//! lets wt-audit's `learn` command compile with the same signature. At merge, take
//! wt-learncore's src/core/learn.rs and drop this one. It writes the start policy back
//! unchanged and learns nothing.

use crate::core::policy::Policy;
use crate::core::trace::Trace;

/// How the writer folds names (see wt-learncore).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LearnOptions {
    /// Sibling names under one parent at which they fold into one wildcard.
    pub fold_at: usize,
}

impl Default for LearnOptions {
    fn default() -> Self {
        LearnOptions { fold_at: 30 }
    }
}

/// The learned policy as YAML, and a line per entry it added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Learned {
    pub yaml: String,
    pub added: Vec<String>,
}

/// PLACEHOLDER: returns `start_text` unchanged.
pub fn learn(
    start_text: &str,
    _start: &Policy,
    _trace: &Trace,
    _options: &LearnOptions,
) -> Learned {
    Learned {
        yaml: start_text.to_string(),
        added: Vec::new(),
    }
}
