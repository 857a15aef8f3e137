//! examples/github-actions.yml and examples/gitlab-ci.yml, run job by job as the CI systems would
//! run them: each step's shell code in bash with `-e`, a `leasectl` on PATH that talks to the test
//! schema, and stub `./scripts/*.sh` that log what they see. GitHub: steps share variables only
//! through `$GITHUB_ENV`; an `if: always()` step runs after a failure. GitLab: a job's `script`
//! lines share one shell, and `after_script` runs in a new one.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::common::*;
use crate::examples::yaml;

/// A CI workspace: `leasectl` on PATH for this test's schema, stub scripts, and a log of what
/// each stub saw (`name fence index token`).
struct Workspace {
    env: Env,
    path: String,
}

impl Workspace {
    fn new() -> Workspace {
        let env = Env::new();
        let bin_dir = env.path("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        let wrapper = format!(
            "#!/bin/sh\nexec '{}' --database-url '{}' --schema '{}' \"$@\"\n",
            bin().display(),
            env.url,
            env.schema
        );
        write_executable(&bin_dir.join("leasectl"), &wrapper);
        let scripts = env.path("scripts");
        std::fs::create_dir_all(&scripts).unwrap();
        for name in [
            "migrate",
            "deploy",
            "deploy-preview",
            "deploy-review",
            "integration",
        ] {
            let stub = format!(
                "#!/bin/sh\necho \"{name} $LEASECTL_FENCE $LEASECTL_HOLDER_INDEX $LEASECTL_TOKEN\" >> '{}'\n",
                env.path("log").display()
            );
            write_executable(&scripts.join(format!("{name}.sh")), &stub);
        }
        let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap());
        Workspace { env, path }
    }

    /// Runs shell code as a CI step: bash -e, in the workspace, with `vars`.
    fn step(&self, code: &str, vars: &BTreeMap<String, String>) -> std::process::Output {
        Command::new("bash")
            .args(["-e", "-c", code])
            .current_dir(self.env.dir.path())
            .env_clear()
            .env("PATH", &self.path)
            .env("HOME", self.env.dir.path())
            .envs(vars)
            .output_in_time()
    }

    /// The stub calls so far: (script, fence, holder index, token).
    fn log(&self) -> Vec<(String, String, String, String)> {
        std::fs::read_to_string(self.env.path("log"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (
                    f[0].into(),
                    f[1].into(),
                    f[2].into(),
                    f.get(3).unwrap_or(&"").to_string(),
                )
            })
            .collect()
    }
}

fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// `NAME=value` lines of a `$GITHUB_ENV` file.
fn env_file(path: &Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The job's one fenced deploy: migrate and deploy ran under one fence and token, their runs are
/// stored under it with the commit as label, and no lease is left held.
fn assert_one_lease_across_steps(ws: &Workspace, target: &str, sha: &str) {
    let log = ws.log();
    let steps: Vec<_> = log
        .iter()
        .filter(|(s, ..)| s == "migrate" || s == "deploy")
        .collect();
    assert_eq!(steps.len(), 2, "{log:?}");
    assert_eq!(steps[0].1, steps[1].1, "one fence: {log:?}");
    assert_eq!(steps[0].3, steps[1].3, "one token: {log:?}");
    let runs = ws.env.scalar(&format!(
        "SELECT count(*) FROM runs WHERE target = '{target}' AND fence = {} AND label = '{sha}'
            AND outcome = 'completed'",
        steps[0].1
    ));
    assert_eq!(runs, "2");
    assert_eq!(ws.env.held_leases(), "0");
}

#[test]
fn the_github_actions_example_runs_job_by_job() {
    let doc = yaml("github-actions.yml");
    let jobs = doc["jobs"].as_mapping().expect("jobs");
    let sha = "0123abcd";
    let mut ran = Vec::new();
    for (name, job) in jobs {
        let name = name.as_str().unwrap();
        let ws = Workspace::new();
        let github_env = ws.env.path("github_env");
        let mut vars = BTreeMap::from([
            ("GITHUB_SHA".to_owned(), sha.to_owned()),
            ("GITHUB_ENV".to_owned(), github_env.display().to_string()),
        ]);
        let mut failed = false;
        for step in job["steps"].as_sequence().unwrap() {
            let Some(script) = step["run"].as_str() else {
                continue; // `uses:` steps
            };
            if script.contains("cargo install") {
                continue;
            }
            // `if: always() && env.X != ''` runs after a failure too, when X is set.
            if let Some(cond) = step["if"].as_str() {
                assert!(cond.starts_with("always()"), "{name}: {cond}");
                let needs = cond
                    .split("env.")
                    .nth(1)
                    .map(|r| r.split(' ').next().unwrap());
                if needs.is_some_and(|v| !vars.contains_key(v)) {
                    continue;
                }
            } else if failed {
                continue;
            }
            let script = script.replace("${{ github.event.number }}", "7");
            let o = ws.step(&script, &vars);
            failed |= !o.status.success();
            assert_eq!(code(&o), 0, "{name}: {script}: {}", stderr(&o));
            vars.extend(env_file(&github_env));
        }
        match name {
            "deploy" => assert_one_lease_across_steps(&ws, "deploy-production", sha),
            "staging" | "preview" | "integration" => {
                let log = ws.log();
                assert_eq!(log.len(), 1, "{name}: {log:?}");
                let label = ws.env.scalar("SELECT label FROM runs");
                assert_eq!(label, sha, "{name}");
                if name == "integration" {
                    assert_eq!(log[0].2, "0", "{log:?}");
                }
            }
            other => panic!("a job this test does not know: {other}"),
        }
        ran.push(name.to_owned());
    }
    assert_eq!(ran, ["deploy", "staging", "preview", "integration"]);
}

#[test]
fn the_gitlab_ci_example_runs_job_by_job() {
    let doc = yaml("gitlab-ci.yml");
    let sha = "4567cdef";
    let vars = BTreeMap::from([
        ("CI_COMMIT_SHA".to_owned(), sha.to_owned()),
        ("CI_MERGE_REQUEST_IID".to_owned(), "5".to_owned()),
    ]);
    let mut ran = Vec::new();
    for (name, job) in doc.as_mapping().unwrap() {
        let name = name.as_str().unwrap();
        let Some(script) = job["script"].as_sequence() else {
            continue; // `stages:`
        };
        let ws = Workspace::new();
        let lines: Vec<&str> = script.iter().map(|l| l.as_str().unwrap()).collect();
        let o = ws.step(&lines.join("\n"), &vars);
        assert_eq!(code(&o), 0, "{name}: {}", stderr(&o));
        if let Some(after) = job["after_script"].as_sequence() {
            let lines: Vec<&str> = after.iter().map(|l| l.as_str().unwrap()).collect();
            let o = ws.step(&lines.join("\n"), &vars);
            assert_eq!(code(&o), 0, "{name} after_script: {}", stderr(&o));
        }
        match name {
            "deploy-production" => assert_one_lease_across_steps(&ws, "deploy-production", sha),
            "deploy-staging" | "deploy-review" | "integration" => {
                assert_eq!(ws.log().len(), 1, "{name}: {:?}", ws.log());
                assert_eq!(ws.env.scalar("SELECT label FROM runs"), sha, "{name}");
            }
            other => panic!("a job this test does not know: {other}"),
        }
        ran.push(name.to_owned());
    }
    assert_eq!(
        ran,
        [
            "deploy-production",
            "deploy-staging",
            "deploy-review",
            "integration"
        ]
    );
}

/// A failed deploy step still releases the lease in after_script (GitLab runs it after a failure).
#[test]
fn the_gitlab_after_script_releases_the_lease_after_a_failed_step() {
    let doc = yaml("gitlab-ci.yml");
    let job = &doc["deploy-production"];
    let ws = Workspace::new();
    write_executable(&ws.env.path("scripts/deploy.sh"), "#!/bin/sh\nexit 3\n");
    let vars = BTreeMap::from([("CI_COMMIT_SHA".to_owned(), "f".to_owned())]);
    let lines: Vec<&str> = job["script"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    let o = ws.step(&lines.join("\n"), &vars);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert_eq!(ws.env.held_leases(), "1", "held until after_script");
    let after: Vec<&str> = job["after_script"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    let o = ws.step(&after.join("\n"), &vars);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(ws.env.held_leases(), "0");
}
