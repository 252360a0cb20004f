"""The SLURM launch scripts, for real: a one-node SLURM cluster on localhost runs each sbatch script
(the distributed benchmark on CPU, gloo, 2 processes) and we check the results file.

Needs Debian's slurm-wlm and munge (``.ci/run`` installs them) and root; skipped otherwise. Only
the daemons this test starts are stopped, by their PIDs.
"""
import os
import shutil
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port

from dilated.bench import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ["sbatch", "squeue", "scontrol", "sinfo", "slurmctld", "slurmd", "munged", "munge"]
missing = [c for c in NEEDED if shutil.which(c) is None and not os.path.exists(f"/usr/sbin/{c}")]
pytestmark = [
    pytest.mark.skipif(bool(missing), reason=f"SLURM is not installed here (missing: {', '.join(missing)}); "
                                             "apt-get install -y slurm-wlm munge"),
    pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() != 0, reason="starting slurmd/munged needs root"),
]

CONF = """ClusterName=dilatedtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MailProg=/bin/true
EnforcePartLimits=ALL
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={state}/state
SlurmdSpoolDir={state}/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd.log
SchedulerType=sched/backfill
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
Waittime=0
NodeName={host} CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _sbin(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _pid(path, timeout=15):
    end = time.time() + timeout
    while time.time() < end:
        try:
            return int(Path(path).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            time.sleep(0.2)
    raise RuntimeError(f"no pid file {path}")


def _node_resources():
    out = subprocess.run([_sbin("slurmd"), "-C"], capture_output=True, text=True).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return int(fields.get("CPUs", os.cpu_count() or 2)), max(1000, int(fields.get("RealMemory", 4000)) - 1000)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool", "log"):
        (state / d).mkdir()
    started = []
    env = dict(os.environ)
    # munge: reuse a running munged, else start one as the munge user
    if subprocess.run(["sh", "-c", "munge -n | unmunge"], capture_output=True).returncode != 0:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        subprocess.run(["chown", "munge:munge", str(key)], check=True)
        key.chmod(0o400)
        os.makedirs("/run/munge", exist_ok=True)
        subprocess.run(["chown", "munge:munge", "/run/munge"], check=True)
        subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged")], check=True)
        started.append(_pid("/run/munge/munged.pid"))
    host = socket.gethostname().split(".")[0]
    cpus, mem = _node_resources()
    conf = state / "slurm.conf"
    conf.write_text(CONF.format(host=host, state=state, cpus=cpus, mem=mem, ctld_port=free_port(),
                                d_port=free_port()))
    env["SLURM_CONF"] = str(conf)
    try:
        subprocess.run([_sbin("slurmctld"), "-f", str(conf)], check=True, env=env)
        started.append(_pid(state / "slurmctld.pid"))
        subprocess.run([_sbin("slurmd"), "-f", str(conf)], check=True, env=env)
        started.append(_pid(state / "slurmd.pid"))
        end = time.time() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                           env=env).stdout:
            if time.time() > end:
                raise RuntimeError("the SLURM node never became idle: " + (state / "log/slurmctld.log").read_text()[-2000:])
            time.sleep(0.5)
        yield env, cpus
    finally:
        for pid in reversed(started):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in started:
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                    time.sleep(0.1)
                except ProcessLookupError:
                    break


def _run_job(env, args, out_dir, timeout=600):
    res = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    end = time.time() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env).stdout.strip():
        assert time.time() < end, f"job {job} still queued/running after {timeout} s"
        time.sleep(1)
    info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    log = "\n".join(p.read_text() for p in Path(out_dir).glob("*.out"))
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + log[-4000:]
    return job, log


@pytest.mark.parametrize("script", ["slurm_single_node.sbatch", "slurm_multi_node.sbatch", "slurm_srun.sbatch"])
def test_sbatch_script_runs_the_distributed_benchmark(slurm, script, tmp_path):
    env, cpus = slurm
    env = dict(env, PYTHON=sys.executable, NPROC_PER_NODE="2", RUN_DIR=str(tmp_path / "run"),
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    # what a user edits in the header, given on the command line for this CPU-only one-node cluster
    args = ["--partition=debug", "--nodes=1", "--gpus-per-node=0", f"--output={tmp_path}/%x-%j.out",
            "--time=00:10:00", "--export=ALL"]
    args += ["--ntasks-per-node=2", "--cpus-per-task=1"] if "srun" in script else [f"--cpus-per-task={min(cpus, 2)}"]
    _, log = _run_job(env, args + [str(ROOT / "launch" / script), "benchmarks/core/benchmark_distributed.py",
                                   "--seq-lengths", "256", "--reps", "2", "--warmup", "1", "--no-progress",
                                   "--implementations", "ring_zigzag,distributed_dilated", "--causal"], tmp_path)
    rows = read_jsonl(str(tmp_path / "run" / "results.jsonl"))
    assert "results:" in log
    dist_rows = [r for r in rows if r.get("role") == "distributed"]
    assert {r["implementation"] for r in dist_rows} == {"ring_zigzag", "distributed_dilated"}
    for r in rows:
        assert r["status"] == "ok" and r["check"]["passed"], r
    assert all(r["world_size"] == 2 for r in dist_rows)
