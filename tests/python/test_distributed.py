"""heads under torch.distributed (gloo): ring attention and DistributedDataParallel, on real processes.

The ranks are separate Python processes (tests/python/dist_worker.py) talking over loopback TCP, or
across two network namespaces joined by a veth pair (two hosts as far as the network stack goes).
Every rank checks its results itself; a mismatch fails the rank and so the test.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def finish(procs, what: str, timeout: float = 300) -> dict:
    """Waits for every rank; fails with every rank's output unless all exit 0. Returns rank 0's JSON.
    A rank still running after `timeout` seconds is killed (its process group with it) and reported
    with what it printed, as are the others."""
    outs = []
    timed_out = []
    try:
        for r, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out.append(r)
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
            outs.append(out)
    finally:
        for p in procs:  # each started in its own session: torchrun's workers go with it
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    report = "\n".join(f"--- rank {r} (exit {p.returncode}{', killed after %gs' % timeout if r in timed_out else ''})\n"
                       f"{o[-3000:]}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert not timed_out and all(p.returncode == 0 for p in procs), f"{what}:\n{report}"
    lines = [ln for ln in outs[0].splitlines() if ln.startswith("{")]
    assert lines, f"{what}: rank 0 printed no result\n{report}"
    return json.loads(lines[-1])


def run_ranks(mode: str, world: int) -> dict:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                              text=True, env=child_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(world)]
    return finish(procs, f"{mode} on {world} ranks")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_equals_single_process(world):
    # forward and dq/dk/dv of every rank's shard within 1e-5 of heads and of torch in float64;
    # causal and not, both layouts, GQA, odd head sizes, lengths that do not divide, shards of the
    # caller's lengths, key padding (3 ranks: a ring whose next and previous differ and are not the
    # same peer as with 2); bad or disagreeing arguments raise on every rank
    # (tests/python/dist_worker.py: ring, ring_errors)
    r = run_ranks("ring", world)
    assert r["world"] == world
    assert r["forward"] <= 1e-5 and r["backward"] <= 1e-5 and r["torch_f64"] <= 1e-5, r
    assert r["cases"] == 15, r


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_under_torchrun(mode):
    # DDP: one SGD step; FSDP2 (fully_shard, parameters sharded over the ranks): two SGD steps with momentum.
    # Gradients and parameters equal one process's on the whole batch within 1e-6.
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun (from torch) is not on PATH"
    port = free_port()
    p = subprocess.Popen([torchrun, "--nproc_per_node=2", f"--master_port={port}", str(WORKER), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True, env=child_env())
    r = finish([p], f"{mode} under torchrun --nproc_per_node=2")
    assert r["world"] == 2 and r["grad"] <= 1e-6 and r["after_step"] <= 1e-6, r
    if mode == "fsdp":
        assert r["sharded_params"] > 0, r


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 10.213.x.1 and 10.213.x.2 (root only)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("HEADS_REQUIRE_NETNS") == "1":
            pytest.fail("HEADS_REQUIRE_NETNS=1 but network namespaces need root and iproute2's `ip`")
        pytest.skip("network namespaces need root and iproute2's `ip` (CI runs this as root)")
    tag = uuid.uuid4().hex[:6]
    ns, veth = [f"heads{tag}a", f"heads{tag}b"], [f"hv{tag}a", f"hv{tag}b"]
    net = f"10.213.{int(tag[:2], 16)}"
    try:
        for n in ns:
            _ip("netns", "add", n)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i, (n, v) in enumerate(zip(ns, veth)):
            _ip("link", "set", v, "netns", n)
            _ip("-n", n, "addr", "add", f"{net}.{i + 1}/24", "dev", v)
            _ip("-n", n, "link", "set", v, "up")
            _ip("-n", n, "link", "set", "lo", "up")
        yield ns, veth, [f"{net}.1", f"{net}.2"]
    finally:
        for n in ns:
            _ip("netns", "del", n, check=False)  # takes its end of the veth pair with it


def test_ddp_across_two_network_namespaces(two_hosts):
    # One rank per "host", each started in its namespace with the variables torchrun would set, and
    # rendezvous through the TCP store on the first host's address. Not torchrun itself: with two
    # launchers, its agents end with an exit barrier on a store that lives in the first one, which can
    # leave that launcher waiting its whole 300 s timeout after the work is done (pytorch/pytorch#69520).
    # torchrun's own launch is covered by test_data_parallel_under_torchrun.
    ns, veth, addrs = two_hosts
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = ["ip", "netns", "exec", ns[node], sys.executable, str(WORKER), "ddp"]
        # gloo on the veth only: the namespaces have no other route between them
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True,
                                      env=child_env(GLOO_SOCKET_IFNAME=veth[node], RANK=str(node), WORLD_SIZE="2",
                                                    LOCAL_RANK="0", MASTER_ADDR=addrs[0], MASTER_PORT=port)))
    r = finish(procs, "ddp across two network namespaces", timeout=180)
    assert r["world"] == 2 and r["grad"] <= 1e-6 and r["after_step"] <= 1e-6, r
