//! `egress-fence exec` in a world: the policy every exec test starts from, the command line
//! (inside the sandbox with `--netns`, so exec's namespace and pasta see the sandbox as the
//! host) and how an outcome is shown when a test fails. Not re-exported with the rest of the
//! harness (its names are short): `use common::exec::*`.

use std::process::{Command, Output, Stdio};

use super::*;

/// The port the policy opens for [`ALLOWED`].
pub const PORT: u16 = 8080;
/// A port the policy does not open.
pub const OTHER_PORT: u16 = 9090;
/// The name the policy allows (answered with [`HOST_V4`]).
pub const ALLOWED: &str = "registry.example.test";

/// A guard-mode policy allowing [`ALLOWED`] on TCP [`PORT`], refusals logged to group 100.
pub fn policy_text() -> String {
    format!(
        "version: 1\nallow:\n  - domain: \"{ALLOWED}\"\n    ports: [{PORT}]\n\
         dns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n\
         log:\n  group: 100\n  rate: 1000/second\n  burst: 1000\n"
    )
}

/// A world with [`ALLOWED`] answered and the policy written; returns the policy's path.
pub fn setup(w: &World) -> String {
    w.dns_set(ALLOWED, &[HOST_V4], 60);
    w.write_file("exec.yaml", &policy_text())
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

/// `egress-fence exec --netns SANDBOX --policy POLICY [extra] -- sh -c SCRIPT` with `extra`
/// as given and `SUDO_USER` set to `sudo_user` (or unset).
pub fn exec_command_as(
    w: &World,
    policy: &str,
    extra: &[&str],
    sudo_user: Option<&str>,
    script: &str,
) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "5", "40", EGRESS_FENCE_BIN, "exec"])
        .args(["--netns", w.sandbox_name(), "--policy", policy])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .env("EGRESS_FENCE_STATE_DIR", w.state_dir())
        .stdin(Stdio::null());
    match sudo_user {
        Some(user) => cmd.env("SUDO_USER", user),
        None => cmd.env_remove("SUDO_USER"),
    };
    cmd
}

/// [`exec_command_as`] without `SUDO_USER`, with `--user root` unless `extra` names a user
/// (exec refuses to run CMD as root unless told).
pub fn exec_command(w: &World, policy: &str, extra: &[&str], script: &str) -> Command {
    let mut args = extra.to_vec();
    if !args.contains(&"--user") {
        args.extend(["--user", "root"]);
    }
    exec_command_as(w, policy, &args, None, script)
}

/// [`exec_command`], run to its end.
pub fn exec(w: &World, policy: &str, extra: &[&str], script: &str) -> Output {
    exec_command(w, policy, extra, script)
        .output()
        .expect("run egress-fence exec")
}

/// An outcome as a failing test shows it.
pub fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// What CMD printed.
pub fn stdout_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// CMD's workspace at `dir`, as a CI job has it: a directory `nobody` (CMD's `--user`) owns,
/// 0755.
pub fn cmds_workspace(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(dir).expect("mkdir");
    std::os::unix::fs::chown(dir, Some(NOBODY), Some(NOBODY)).expect("chown");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// [`exec_command`] started in `dir` (CMD's working directory), run to its end.
pub fn exec_in(
    w: &World,
    dir: &std::path::Path,
    policy: &str,
    extra: &[&str],
    script: &str,
) -> Output {
    exec_command(w, policy, extra, script)
        .current_dir(dir)
        .output()
        .expect("run egress-fence exec")
}
