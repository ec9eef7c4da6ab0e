"""Server replicas on the SLURM side (#12): the recipe's `replicas`, `min_replicas` and resources list, one job per
replica on both launch paths, the trainer job's wait for `min_replicas` healthy replicas, `add-server`, the ports of
replicas SLURM puts on one node, and `status` per replica. Without a cluster: `sbatch`, `squeue` and `scancel` are
stand-ins on PATH (tests/slurm_helpers.fake_slurm_commands) that record every call; the replicas that answer are
real built-in servers. tests/test_slurm.py and test_launcher.py run replicas on the real one-node cluster.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from open_r1_ext.config.recipe import RecipeError, load_recipe
from open_r1_ext.launch import jobs
from open_r1_ext.launch.jobs import (JobRef, JobWatch, LaunchError, add_server, node_port, read_jobs_file,
                                     register_jobs, submit_run, wait_for_replicas)
from open_r1_ext.launch.run_status import format_status, run_status
from open_r1_ext.launch.slurm_plan import PlanError, RunFiles, SlurmPlan
from tests.slurm_helpers import RECIPE, REPO

TWO_PARTITIONS = ("servers.generation.resources=[{gpus_per_node: 0, cpus_per_task: 1}, "
                  "{gpus_per_node: 0, cpus_per_task: 2, mem: 4G, partition: cpu-big}]")


@pytest.fixture()
def make_plan(tiny_model, tmp_path, monkeypatch):
    """`make(*overrides)`: the tiny recipe's plan (run directory in tmp_path), loaded from the repository root."""
    monkeypatch.chdir(REPO)

    def make(*overrides) -> SlurmPlan:
        items = [f"model.name_or_path={tiny_model}", f"trainer.output_dir={tmp_path / 'run'}", *overrides]
        return SlurmPlan(load_recipe(RECIPE, items), items)
    return make


# ------------------------------------------------------------------------------------------ recipe
@pytest.mark.parametrize("overrides, key, message", [
    (["servers.generation.replicas=2", "servers.generation.min_replicas=3"], "servers.generation.min_replicas",
     "3 is more than replicas (2): the trainer would wait for servers that are never started; set it to at most 2"),
    (["servers.generation.replicas=3", TWO_PARTITIONS], "servers.generation.resources",
     "a list of 2 resource mapping(s) for replicas: 3; give one per replica, or one mapping for all"),
    (["servers.generation.replicas=2", "servers.generation.resources=[{gpus_per_node: 0}, {gpus_per_node: x}]"],
     "servers.generation.resources[1].gpus_per_node", "expected an integer, got 'x'"),
    (["servers.generation.replicas=2", "servers.generation.resources=[{gpus_per_node: 0}, {nodes: 2, gpus_per_node: 0}]"],
     "servers.generation.tp_size", "resources[1].nodes 1"),
    (["servers.generation.url=http://node-3:30000", "servers.generation.replicas=2"], "servers.generation.replicas",
     "a server already running at url (http://node-3:30000) is one server, no job is started for it: remove replicas "
     "(several running servers: give open-r1-ext train one --server-url per server)"),
    (["servers.generation={engine: openai, url: 'http://h:1', min_replicas: 1}", "servers.reference=local"],
     "servers.generation.min_replicas", "remove min_replicas"),
    (["servers.generation.replicas=0"], "servers.generation.replicas", "must be >= 1, got 0"),
    (["servers.reference={engine: sglang, replicas: 2, resources: [{gpus_per_node: 1}, {gpus_per_node: 0}]}"],
     "servers.reference.resources[1].gpus_per_node", "0: SGLang runs on GPUs"),
])
def test_replica_settings_are_checked(make_plan, overrides, key, message):
    with pytest.raises(RecipeError) as err:
        make_plan(*overrides)
    assert any(k == key and message in m for k, m in err.value.problems), err.value.problems


def test_each_replica_job_gets_its_resources_entry_and_partition(make_plan):
    plan = make_plan("servers.generation.replicas=2", "servers.generation.min_replicas=1", TWO_PARTITIONS)
    assert plan.jobs_of("server") == [("server job 1/2", 0), ("server job 2/2", 1)]
    assert plan.jobs_of("trainer") == [("trainer job", 0)]
    assert plan.recipe.servers.describe() == "generation on 2 builtin server replicas, reference in the generation server"
    first, second = plan.sbatch_args("server", 0), plan.sbatch_args("server", 1)
    assert "--partition=debug" in first and "--cpus-per-task=1" in first and "--mem=4G" not in first
    assert "--partition=cpu-big" in second and "--cpus-per-task=2" in second and "--mem=4G" in second
    assert plan.srun_args("server", 1) == ["--nodes=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=2"]
    assert plan.submitit_parameters("server", 1)["slurm_partition"] == "cpu-big"
    assert f"--error={plan.files.run_dir}/logs/server/%j_0_log.err" in plan.sbatch_args("server", 1, "submitit")
    with pytest.raises(PlanError, match=r"servers.generation.resources: no entry 2 \(resources index\), it has 2"):
        plan.check_index("server", 2)
    uniform = make_plan("servers.generation.replicas=3")
    assert [index for _, index in uniform.jobs_of("server")] == [0, 0, 0]  # one mapping for all
    with pytest.raises(PlanError, match="no entry 1"):
        uniform.check_index("server", 1)


# -------------------------------------------------------------------------------------- submission
def test_sbatch_launch_submits_every_replica_then_the_trainer(make_plan, fake_slurm, signal_handlers, capsys):
    """Three replicas, two needed: the trainer job depends on the first two having started; jobs.env lists all."""
    calls = fake_slurm()
    plan = make_plan("servers.generation.replicas=3", "servers.generation.min_replicas=2")
    assert submit_run(plan, echo=lambda m: None) == 0
    sbatch = [line for line in calls.read_text().splitlines() if line.startswith("sbatch ")]
    assert len(sbatch) == 4
    for line in sbatch[:3]:
        assert line.endswith("--role server --resources-index 0") and "serve.slurm" in line  # one mapping for all
        plan.check_index("server", int(line.split()[-1]))  # what the server job checks first
    assert "--dependency=after:100:101 --kill-on-invalid-dep=yes" in sbatch[3] and "train.slurm" in sbatch[3]
    env = jobs.read_jobs_env(plan.files)
    assert (env["SERVER_JOB"], env["TRAINER_JOB"], env["LAUNCHER"]) == ("100,101,102", "103", "sbatch")
    assert env["LAUNCH_DIR"] == str(REPO) and env["RECIPE_ARGS"].startswith(f"{REPO / RECIPE} --set=model.name_or_path=")
    assert [str(ref) for ref in read_jobs_file(plan.files)] == [
        "server job 100", "server job 101", "server job 102", "trainer job 103"]
    assert "jobs 100 101 102 103" in capsys.readouterr().out


def test_a_submission_that_fails_half_way_cancels_every_replica(make_plan, fake_slurm, signal_handlers):
    calls = fake_slurm(sbatch_ok=2)  # the two replicas are accepted, the trainer is refused
    plan = make_plan("servers.generation.replicas=2")
    with pytest.raises(LaunchError, match="sbatch of the trainer job failed: sbatch: error: job submit limit reached"):
        submit_run(plan, echo=lambda m: None)
    assert calls.read_text().splitlines()[-1] == "scancel 100 101"
    assert "submission failed: cancelled job(s) 100 101" in plan.files.status.read_text()


def test_add_server_submits_one_more_replica_for_a_running_run(make_plan, fake_slurm, signal_handlers, tmp_path,
                                                               monkeypatch):
    calls = fake_slurm("102|RUNNING|0\n")
    plan = make_plan("servers.generation.replicas=2", TWO_PARTITIONS)
    submit_run(plan, echo=lambda m: None)
    monkeypatch.chdir(tmp_path)  # elsewhere: the recipe's relative paths are read from where the run was launched
    ref = add_server(plan.files.run_dir, "server", 1, echo=lambda m: None)
    assert str(ref) == "server job 103" and ref.log == f"{plan.files.logs}/server-103.err"
    line = calls.read_text().splitlines()[-1]
    assert line.startswith("sbatch --parsable --job-name=grpo-tiny-server ") and "--partition=cpu-big" in line
    assert line.endswith("--role server --resources-index 1") and f"--set=trainer.output_dir={plan.files.run_dir}" in line
    assert jobs.read_jobs_env(plan.files)["SERVER_JOB"] == "100,101,103"  # the run's end cancels it too
    assert f"submitted server job 103 (logs: {plan.files.logs}/server-103.out, .err)" in plan.files.status.read_text()

    with pytest.raises(PlanError, match="no entry 2"):
        add_server(plan.files.run_dir, "server", 2)
    with pytest.raises(LaunchError, match=r"the run starts no ref-server jobs \(its servers: server\)"):
        add_server(plan.files.run_dir, "ref-server", 0)
    env = plan.files.jobs.read_text()
    plan.files.jobs.write_text(env.replace(f"LAUNCH_DIR={REPO}", "LAUNCH_DIR=/no/such/dir"))
    with pytest.raises(LaunchError, match="LAUNCH_DIR /no/such/dir: No such file or directory; run add-server on a"):
        add_server(plan.files.run_dir)
    plan.files.jobs.write_text(env)
    fake_slurm("102|COMPLETED|0\n")
    with pytest.raises(LaunchError, match=r"the run's trainer job 102 has ended \(COMPLETED\): there is no run to join"):
        add_server(plan.files.run_dir)
    result = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "add-server", str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "jobs.env: no such file: add-server joins a run launched with" in result.stderr
    assert "nothing submitted" in result.stderr


# --------------------------------------------------------------------------------------------- waits
def test_the_trainer_waits_for_min_replicas_healthy(make_plan, fake_slurm, server, monkeypatch):
    """Replica 11 answers (a real built-in server), 12 never advertises itself; 13 is added during the run."""
    monkeypatch.setattr(jobs, "POLL_S", 1)
    squeue = fake_slurm("11|RUNNING|0\n12|RUNNING|0\n13|RUNNING|0\n")
    address = server.url.removeprefix("http://")
    plan = make_plan("servers.generation.replicas=2", "trainer.server_wait_timeout=3")
    register_jobs(plan.files, [JobRef("server", "11"), JobRef("server", "12")], plan, "sbatch")
    jobs.write_atomic(plan.files.replica_addr("server", "11"), address + "\n")
    assert wait_for_replicas(plan, JobWatch(), echo=lambda m: None) == {"server": {"11": server.url}}

    plan = make_plan("servers.generation.replicas=2", "servers.generation.min_replicas=2", "trainer.server_wait_timeout=3")
    lines: list[str] = []
    with pytest.raises(LaunchError) as err:
        wait_for_replicas(plan, JobWatch(), echo=lines.append)
    assert str(err.value).startswith("1 of 2 server replica(s) healthy after 3 s (trainer.server_wait_timeout): "
                                     "server job 12 (RUNNING): no address yet; see ")
    assert any(line.startswith("waiting for servers, 1 of 2 server replica(s) healthy: server job 12 (RUNNING)")
               for line in lines), lines

    fake_slurm("11|RUNNING|0\n12|FAILED|0\n")
    with pytest.raises(LaunchError, match=r"1 of the 2 server jobs may still serve, and the trainer needs 2 \(servers"
                                          r".generation.min_replicas\): server job 12 ended \(FAILED\) before its "
                                          r"server became healthy; see .*/logs/server-12.err"):
        wait_for_replicas(plan, JobWatch(), echo=lambda m: None)

    fake_slurm("11|RUNNING|0\n12|FAILED|0\n13|RUNNING|0\n")
    register_jobs(plan.files, [JobRef("server", "13")])  # add-server
    jobs.write_atomic(plan.files.replica_addr("server", "13"), address + "\n")
    assert wait_for_replicas(plan, JobWatch(), echo=lambda m: None) == {"server": {"11": server.url, "13": server.url}}
    assert "squeue" in squeue.read_text()


def test_replicas_on_one_node_each_get_a_port(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "PORT_CLAIMS", tmp_path / "ports")
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        preferred = probe.getsockname()[1]
    with node_port(preferred, "1") as first, node_port(preferred, "2") as second:
        assert first == preferred and second != preferred  # the second replica starting here: claimed
        assert (tmp_path / "ports" / f"{first}.port").read_text() == "1"
    assert not list((tmp_path / "ports").glob("*.port"))  # released when the jobs end
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", preferred))
        busy.listen()
        with node_port(preferred, "3") as third:
            assert third != preferred  # something else listens there
    with node_port(preferred, "4") as again:
        assert again == preferred


# -------------------------------------------------------------------------------------------- status
def test_status_shows_each_replica(fake_slurm, server, tmp_path):
    """Replica 21 serves, 22 stopped (its URL from status.log), and one advertised itself without a jobs.env line."""
    fake_slurm("21|RUNNING|0\n22|CANCELLED|0\n23|RUNNING|0\n")
    run_dir = tmp_path / "run"
    (run_dir / "replicas" / "server").mkdir(parents=True)
    (run_dir / "jobs.env").write_text("SERVER_JOB=21,22\nTRAINER_JOB=23\nEXECUTOR=slurm\nLAUNCHER=sbatch\n")
    (run_dir / "replicas" / "server" / "21.addr").write_text(server.url.removeprefix("http://") + "\n")
    (run_dir / "replicas" / "server" / "by-hand.addr").write_text("127.0.0.1:9\n")
    (run_dir / "status.log").write_text("2026-12-03T09:00:00+00:00 server job 22: healthy at http://node-9:30000\n")
    status = run_status(run_dir)
    assert [(j["role"], j["job_id"], j["state"]) for j in status["jobs"]] == [
        ("server", "21", "RUNNING"), ("server", "22", "CANCELLED"), ("trainer", "23", "RUNNING")]
    serving, stopped, by_hand = status["servers"]
    assert (serving["job_id"], serving["url"], serving["healthy"]) == ("21", server.url, True)
    assert serving["weight_version"] is not None and serving["error"] is None
    assert (stopped["job_id"], stopped["url"], stopped["healthy"]) == ("22", "http://node-9:30000", False)
    assert (by_hand["job_id"], by_hand["url"], by_hand["healthy"]) == ("by-hand", "http://127.0.0.1:9", False)
    text = format_status(status)
    assert f"server    server 21 {server.url}: healthy, weights {serving['weight_version']}" in text
    assert "server    server 22 http://node-9:30000: NOT HEALTHY" in text


def test_a_server_job_sbatched_by_hand_joins_its_run(tmp_path):
    """`sbatch slurm/serve.slurm RECIPE` for a running run: the job adds itself to jobs.env (so the run's end cancels
    it) when it starts; a SLURM job does not join a run of local processes."""
    files = RunFiles(tmp_path / "run")
    register_jobs(files, [JobRef("server", "300"), JobRef("trainer", "301")])
    jobs._join(files, JobRef("server", "302"), echo=lambda m: None)
    jobs._join(files, JobRef("server", "302"), echo=lambda m: None)  # a requeued start: listed once
    assert jobs.read_jobs_env(files)["SERVER_JOB"] == "300,302"
    assert "server job 302: joined the run (added to" in files.status.read_text()
    local = RunFiles(tmp_path / "local")
    register_jobs(local, [JobRef("trainer", "4242", "local")])
    jobs._join(local, JobRef("server", "303"), echo=lambda m: None)
    assert "SERVER_JOB" not in jobs.read_jobs_env(local)
