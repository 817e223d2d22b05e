//! The image under podman, run as deploy/kubernetes/daemonset.yaml runs it (root with the
//! DaemonSet's five capabilities and no others, host network and PID namespaces, read-only root,
//! no new privileges, the same host paths), next to a second container (a Debian minbase image
//! with python3) whose process holds CLOSE_WAIT sockets. Asserts what an operator would see:
//! `/healthz` 200, `/metrics` clean under `promtool check metrics`, and the leak in
//! `/v1/findings` attributed to that container (its id, runtime podman, and the name and image
//! podman recorded for it). runc and fixed
//! ulimits: what the engine needs on these machines (README "Container image").
use std::{
    fs,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use connreap_bench::sys;

use crate::{image, run};

/// The workload's base: python3 for the leaking process.
const WORKLOAD_IMAGE: &str = "localhost/connreap-test-workload:bookworm";
/// Eight connections to itself whose server side closes at once: the clients, never closed,
/// sit in CLOSE_WAIT held by this process.
const LEAKER: &str = r#"
import socket, time
srv = socket.socket()
srv.bind(("127.0.0.1", 7460))
srv.listen(64)
held = []
for _ in range(8):
    held.append(socket.create_connection(("127.0.0.1", 7460)))
    conn, _ = srv.accept()
    conn.close()
print("ready", flush=True)
time.sleep(3600)
"#;
/// The container flags the engine needs here (runc; fixed limits: no CAP_SYS_RESOURCE).
const ENGINE_FLAGS: &[&str] = &[
    "--runtime",
    "runc",
    "--ulimit",
    "nofile=16384:16384",
    "--ulimit",
    "nproc=4096:4096",
];
/// What the DaemonSet's pod spec amounts to under podman.
const DAEMONSET_FLAGS: &[&str] = &[
    "--network=host",
    "--pid=host",
    "--read-only",
    "--user=0",
    "--cap-drop=ALL",
    "--cap-add=BPF,PERFMON,NET_ADMIN,SYS_ADMIN,SYS_PTRACE",
    "--security-opt=no-new-privileges",
    "--volume=/sys/fs/bpf:/sys/fs/bpf",
    "--volume=/sys/kernel/btf:/sys/kernel/btf:ro",
    "--volume=/sys/kernel/tracing:/sys/kernel/tracing:ro",
    "--volume=/run/lock:/run/lock",
    "--volume=/run/netns:/run/netns:ro,rslave",
    "--volume=/var/lib/containers:/var/lib/containers:ro",
    "--volume=/run/containers:/run/containers:ro",
];

/// Removes the test's containers, whatever happened.
struct Containers(Vec<String>);

impl Drop for Containers {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = Command::new("podman")
                .args(["rm", "--force", "--time", "0", name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn logs(name: &str) -> String {
    Command::new("podman")
        .args(["logs", name])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
        })
        .unwrap_or_default()
}

fn running(name: &str) -> bool {
    output(Command::new("podman").args(["inspect", "--format", "{{.State.Running}}", name]))
        .is_ok_and(|s| s == "true")
}

/// GET `path` with no Accept header: (status, Content-Type, body).
fn get(addr: SocketAddr, path: &str) -> Result<(u16, String, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8(raw).context("not UTF-8")?;
    let (head, body) = raw.split_once("\r\n\r\n").context("bad HTTP response")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status")?;
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    Ok((status, content_type, body.to_string()))
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Build the image, then run it as the DaemonSet does against a leaking container.
pub fn run_test(no_build: bool) -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the image test runs containers with host namespaces: it needs root");
    }
    let t0 = Instant::now();
    let image = image::build(no_build)?;
    image::ensure_debian_image(
        WORKLOAD_IMAGE,
        "workload-base.tar",
        &["--variant=minbase", "--include=python3"],
    )?;
    let promtool = crate::promtool::ensure()?;
    // The agent in the image pins its tracker under the host's /sys/fs/bpf: never at the same
    // time as another test's agent.
    let (_lock, _) = sys::e2e_lock(Duration::from_secs(900))?;
    let tag = std::process::id();
    let (agent, workload) = (
        format!("connreap-imagetest-agent-{tag}"),
        format!("connreap-imagetest-workload-{tag}"),
    );
    let _containers = Containers(vec![agent.clone(), workload.clone()]);
    let dir = std::env::temp_dir().join(format!("connreap-imagetest-{tag}"));
    let result = leak_found_in_image(&image, &agent, &workload, &dir, promtool);
    if result.is_err() {
        eprintln!("xtask: agent container log:\n{}", logs(&agent));
    }
    let _ = fs::remove_dir_all(&dir);
    eprintln!("xtask: image test took {:.1?}", t0.elapsed());
    result
}

fn leak_found_in_image(
    image: &str,
    agent: &str,
    workload: &str,
    dir: &std::path::Path,
    promtool: bool,
) -> Result<()> {
    run(Command::new("podman")
        .args(["run", "--detach", "--name", workload, "--network=none"])
        .args(ENGINE_FLAGS)
        .args([WORKLOAD_IMAGE, "python3", "-c", LEAKER])
        .stdout(Stdio::null()))?;
    let workload_id =
        output(Command::new("podman").args(["inspect", "--format", "{{.Id}}", workload]))?;
    wait_for("the workload's leak", Duration::from_secs(30), || {
        Ok(logs(workload).contains("ready"))
    })?;

    let config_dir = dir.join("config");
    let state_dir = dir.join("state");
    fs::create_dir_all(&config_dir)?;
    fs::create_dir_all(&state_dir)?;
    fs::create_dir_all("/run/netns")?;
    fs::create_dir_all("/run/containers")?;
    fs::create_dir_all("/var/lib/containers")?;
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    fs::write(
        config_dir.join("connreap.toml"),
        format!(
            "[agent]\nlisten = \"{addr}\"\nscan_interval = \"1s\"\n\n\
             [detect]\nclose_wait_min_age = \"2s\"\nclose_wait_threshold = 4\n"
        ),
    )?;
    let started = Instant::now();
    run(Command::new("podman")
        .args(["run", "--detach", "--name", agent])
        .args(ENGINE_FLAGS)
        .args(DAEMONSET_FLAGS)
        .arg(format!(
            "--volume={}:/etc/connreap:ro",
            config_dir.display()
        ))
        .arg(format!(
            "--volume={}:/var/lib/connreap",
            state_dir.display()
        ))
        .arg(image)
        .stdout(Stdio::null()))?;

    wait_for("/healthz 200", Duration::from_secs(60), || {
        if !running(agent) {
            bail!("the agent container exited");
        }
        Ok(get(addr, "/healthz").is_ok_and(|(status, _, _)| status == 200))
    })?;
    eprintln!(
        "xtask: image: /healthz 200 {:.1?} after podman run",
        started.elapsed()
    );

    let (status, content_type, body) = get(addr, "/metrics")?;
    if status != 200 || !content_type.starts_with("text/plain; version=0.0.4") {
        bail!("GET /metrics without Accept: {status} {content_type:?}");
    }
    if promtool {
        check_metrics(&body)?;
    }

    let finding = wait_for_value(
        "the leak attributed to the workload container",
        Duration::from_secs(60),
        || {
            let (status, _, body) = get(addr, "/v1/findings")?;
            if status != 200 {
                bail!("GET /v1/findings: {status} {body}");
            }
            let v: Value = serde_json::from_str(&body)?;
            let list = v.get("findings").unwrap_or(&v);
            Ok(list.as_array().and_then(|fs| {
                fs.iter()
                    .find(|f| {
                        f["kind"] == "close_wait_buildup" && f["container"] == workload_id.as_str()
                    })
                    .cloned()
            }))
        },
    )?;
    if finding["container_runtime"] != "podman"
        || finding["container_name"] != workload
        || finding["container_image"] != WORKLOAD_IMAGE
    {
        bail!("the finding does not name podman, {workload} and {WORKLOAD_IMAGE}: {finding:#}");
    }
    eprintln!(
        "xtask: image: close_wait_buildup in container {} found: {}",
        &workload_id[..12],
        finding["summary"].as_str().unwrap_or_default()
    );

    run(Command::new("podman")
        .args(["stop", "--time", "15", agent])
        .stdout(Stdio::null()))?;
    let code =
        output(Command::new("podman").args(["inspect", "--format", "{{.State.ExitCode}}", agent]))?;
    if code != "0" {
        bail!("the agent container exited {code} on podman stop");
    }
    Ok(())
}

fn check_metrics(body: &str) -> Result<()> {
    if let Err(said) = crate::promtool::check_metrics(body)? {
        bail!("promtool check metrics on the image's /metrics:\n{said}");
    }
    eprintln!("xtask: image: promtool check metrics: clean");
    Ok(())
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    wait_for_value(what, timeout, || Ok(f()?.then_some(())))
}

fn wait_for_value<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().with_context(|| format!("waiting for {what}"))? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}
