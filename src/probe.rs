//! The boundary check (being written).
