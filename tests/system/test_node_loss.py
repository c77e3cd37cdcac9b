"""Surviving the loss of a node (issue 26): several "nodes" on this machine,
each a torchrun agent in a session of its own with its own node-local
memory directory (DSTT_SHM_DIR) and DSTT_NODE_ID; losing a node = SIGKILL
of its whole session and its capture helpers, and removal of its
directory. The job is then restarted (the lost node replaced by a fresh
one) and every step the memory tiers held must be committed, bit-exact
against the unsharded reference -- or, beyond what the scheme covers,
named in one warning (tests/dist/node_ranks.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_capture_dist import assert_bits, free_port

import dstt
from dstt.format.verify import verify
from dstt.testing.storewatch import StoreWatch

WORKER = Path(__file__).parents[1] / "dist" / "node_ranks.py"
pytestmark = pytest.mark.distributed


class Nodes:
    """Torchrun agents, one per node, each in a session of its own."""

    def __init__(self, tmp: Path, n: int, per: int = 1) -> None:
        self.tmp, self.n, self.per = tmp, n, per  # (``per`` ranks on each node: ranks node*per ... node*per+per-1)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.helpers: list[int] = []

    def shm(self, node: int) -> Path:
        return self.tmp / f"shm-node{node}"

    def start(self, phase: str, scheme: str, steps: int = 8, **extra_env: str) -> None:
        port = free_port()
        (self.tmp / "tmp").mkdir(exist_ok=True)  # (torchrun's own scratch: a killed agent leaves it behind)
        for node in range(self.n):
            self.shm(node).mkdir(exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.n}", f"--node-rank={node}",
                   f"--nproc-per-node={self.per}", "--master-addr=127.0.0.1", f"--master-port={port}", str(WORKER),
                   str(self.tmp), phase, scheme, str(steps)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]),
                   "DSTT_SHM_DIR": str(self.shm(node)), "DSTT_NODE_ID": f"node{node}", "DSTT_RANK_WAIT_S": "30",
                   "TMPDIR": str(self.tmp / "tmp"), **extra_env}
            log = open(self.tmp / f"{phase}-node{node}.log", "ab")  # noqa: SIM115 - closed with the process
            self.procs[node] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)
            log.close()

    def wait_files(self, pattern: str, timeout_s: float = 180) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            files = [self.tmp / pattern.format(r) for r in range(self.n * self.per)]
            if all(f.exists() for f in files):
                return [json.loads(f.read_text()) for f in files]
            if any(p.poll() not in (None, 0) for p in self.procs.values()):
                break
            time.sleep(0.1)
        self.kill_all()
        pytest.fail(f"{pattern} not written by every node:\n{self.logs()}")

    def lose(self, node: int, remove: bool = True) -> None:
        """SIGKILL the node's capture helper(s) and its whole session; its memory directory removed."""
        for rank in range(node * self.per, (node + 1) * self.per):
            info = json.loads((self.tmp / f"rank{rank}.json").read_text())
            for who in ("helper", "trainer"):  # (each a session of its own: torchrun starts workers so)
                if isinstance(info.get(who), int):
                    self.kill_ours(int(info[who]))
        proc = self.procs.pop(node)
        _killpg(proc.pid)
        proc.wait()
        if remove:
            shutil.rmtree(self.shm(node))

    def wait_all(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        for node, proc in list(self.procs.items()):
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"node {node} hung:\n{self.logs()}")
            assert proc.returncode == 0, self.logs()
        self.procs.clear()

    def kill_all(self) -> None:
        """Every agent's session, and every worker's and helper's (each a session of its own)."""
        for proc in self.procs.values():
            _killpg(proc.pid)
            proc.wait()
        self.procs.clear()
        for f in self.tmp.glob("pid-*"):
            self.kill_ours(int(f.name.rsplit("-", 1)[1]))

    def kill_ours(self, pid: int) -> None:
        """SIGKILL ``pid``'s session if it is still one of this test's processes (a pid may be reused)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return
        if str(self.tmp).encode() in cmdline:
            _killpg(pid)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.tmp.glob("*.log")))


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def lose_nodes(tmp_path: Path, scheme: str, lost: list[int], n: int = 2, nowait: bool = False,
               kill_recovery_after_s: float | None = None, corrupt: bool = False, stall: int | None = None,
               steps: int = 8, ddp: bool = False, chosen: list[object] | None = None, per: int = 1,
               state: str = "fsdp", restore: bool = False, seen: list[dict[str, object]] | None = None,
               ls: bool = False, env: dict[str, str] | None = None) -> tuple[Nodes, list[dict[str, object]]]:
    """Train on ``n`` nodes x 1 rank until the held steps are protected
    (``nowait``: lose them at once, copies possibly under way), lose the
    nodes ``lost`` (the others' job dies with them: killed, their memory
    directories kept), restart with fresh nodes in their place
    (``kill_recovery_after_s``: that restart killed too, then another).
    ``ddp``/``state``: how the state is laid out (node_ranks.py); ``per``
    ranks on each node; ``restore``: the restarted job restores the newest
    recovered step with the store's chunk data moved away (node_ranks.py);
    ``seen``: gets each rank's info of the training phase (``ls``: with what
    ``dstt ls`` said of the branch once the held steps were protected);
    ``env``: more environment for every phase."""
    nodes = Nodes(tmp_path, n, per)
    state_env = {"NODE_RANKS_STATE": "ddp" if ddp else state, **(env or {})}
    try:
        env = {**state_env, **({"NODE_RANKS_NOWAIT": "1"} if nowait else {}), **({"NODE_RANKS_LS": "1"} if ls else {}),
               **({"NODE_RANKS_STALL": str(stall)} if stall is not None else {})}
        nodes.start("train", scheme, steps, **env)
        infos = nodes.wait_files("rank{}.json")
        if chosen is not None:
            chosen.extend(i.get("chosen") for i in infos)
        if seen is not None:
            seen.extend(infos)
        if stall is not None:  # rank 1 stopped sealing the step, the others sealed it
            nodes.wait_files("stalled.json")
        for node in lost:
            nodes.lose(node)
        for node in range(n):
            if node not in lost:
                nodes.lose(node, remove=False)  # (the job is torn down: killed, not closed)
        for r in range(n * per):
            (tmp_path / f"rank{r}.json").unlink()
        (tmp_path / "stalled.json").unlink(missing_ok=True)
        if corrupt and scheme == "replicas":
            corrupt_held_chunk(nodes.shm(1 - lost[0]))
        elif corrupt:  # one bit of the newest copy (or parity) flipped where it is kept
            newest = sorted([*nodes.shm(0).rglob("*.blk"), *nodes.shm(0).rglob("*.par")])[-1]
            data = bytearray(newest.read_bytes())
            data[-7] ^= 0x04
            newest.write_bytes(bytes(data))
        if kill_recovery_after_s is not None:
            nodes.start("recover", scheme, **state_env)
            time.sleep(kill_recovery_after_s)
            nodes.kill_all()  # (its helpers are stopped by their trainers' death, or finish alone)
        nodes.start("recover", scheme, **state_env, **({"NODE_RANKS_RESTORE": "1"} if restore else {}))
        recovered = nodes.wait_files("recovered{}.json")
        nodes.wait_all()
    finally:
        nodes.kill_all()
    if not nowait:
        assert all(i["protected"] == infos[0]["protected"] for i in infos)
    return nodes, recovered


def corrupt_held_chunk(shm: Path) -> int:
    """Flip one bit of the newest step's last chunk held as a replica in the
    ring under ``shm`` (after its seal); that step."""
    from dstt.capture.seals import read_record

    newest = sorted(shm.rglob("seal-*.json"))[-1]
    record = read_record(newest.read_bytes())
    statics = record["tasks"]["static"]
    start = max(e[0] for e in record["tasks"]["extents"] if all(len(statics[p]) == 7 for p in e[2]))
    pool = newest.parent / record["pool"]
    data = bytearray(pool.read_bytes())
    data[start] ^= 0x04
    pool.write_bytes(bytes(data))
    return int(record["step"])


def lose_node_after_protection(tmp_path: Path, scheme: str, lost: int) -> tuple[Nodes, list[dict[str, object]]]:
    return lose_nodes(tmp_path, scheme, [lost])


def named_steps(warnings: object) -> set[int]:
    """The steps one NodeLossWarning names ("steps 1-3, 5 were held ..."); every warning is one."""
    assert isinstance(warnings, list) and len(warnings) == 1, warnings
    m = re.search(r"steps ([0-9, -]+) were held in memory by a node that is gone", warnings[0])
    assert m, warnings
    out: set[int] = set()
    for part in m.group(1).split(", "):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def check_bits(tmp_path: Path, steps: list[int]) -> None:
    expected = torch.load(tmp_path / "expected.pt")
    run = dstt.open(tmp_path / "run")
    assert run.steps() == steps
    for step in steps:
        got = run.state_dict(step)
        assert_bits(expected[step]["model"], got["model"], f"step {step} model")
        assert_bits(expected[step]["optim"], got["optim"], f"step {step} optim")
    assert verify(tmp_path / "run").ok


def test_pair_two_nodes_lose_one_after_the_copy(tmp_path: Path) -> None:
    """The representative trial: ``pair``, node 1 lost (its processes and
    its memory) once its held steps are protected; the restarted job
    rebuilds rank 1's shards of steps 5-7 from node 0's copies and commits
    them, bit-exact. The copies went point to point (capture/transport.py):
    the c10d store the helpers meet at (DSTT_REDUNDANCY_STORE, watched
    throughout) held their doorbells and control records, never a block."""
    watch = Watched()
    with StoreWatch(watch.see) as store:
        nodes, recovered = lose_nodes(tmp_path, "pair", [1], env={"DSTT_REDUNDANCY_STORE": store.addr})
    assert recovered[0]["recovered"] == [5, 6, 7], nodes.logs()
    assert recovered[0]["warnings"] == []
    check_bits(tmp_path, [0, 5, 6, 7])
    assert not any(nodes.shm(0).rglob("*.blk"))  # the copies consumed
    assert watch.rang and not watch.blocks, (watch.blocks, nodes.logs())
    assert watch.largest < 4096, watch.largest  # (a block is the ~4 MB image of a rank's shards)


class Watched:
    """What the job's store held (dstt.testing.storewatch): ``blocks``, the
    keys of blocks (the store mailbox's) seen; ``rang``, the runs whose
    transport rang a doorbell (a recovery's: ``recover-...``); ``largest``,
    the largest value seen under the helpers' prefix."""

    def __init__(self) -> None:
        self.blocks: set[str] = set()
        self.rang: set[str] = set()
        self.largest = 0

    def see(self, held: list[tuple[str, bytes]]) -> None:
        for key, value in held:
            if "/p2p//bell/" in key:
                self.rang.add(key.split("/")[1])
            if re.search(r"//(blk|pst|img|par)/", key):
                self.blocks.add(key)
            self.largest = max(self.largest, len(value))


def assert_protected_while_training(seen: list[dict[str, object]], scheme: str, nodes: Nodes) -> None:
    """Steps 5-7 were protected on every rank while training, and ``dstt ls`` said so."""
    for info in seen:
        assert {5, 6, 7} <= set(info["protected"]), (info, nodes.logs())  # type: ignore[call-overload]
    ls = str(seen[0].get("ls"))
    assert f"protected against a node's loss ({scheme}): " in " ".join(ls.split()), ls


def assert_restored_unread(recovered: list[dict[str, object]], step: int, nodes: Nodes) -> None:
    """Every rank restored ``step`` through ``cap.restore`` and ``cap.rewind``
    with the store's chunk data moved away, bit-exact (node_ranks.restore_unread)."""
    for r in recovered:
        got = r["restored"]
        assert isinstance(got, dict) and got["step"] == step, (got, nodes.logs())
        assert got["restore"] is True and got["rewind"] is True, (got, nodes.logs())


@pytest.mark.slow
@pytest.mark.parametrize("scheme,lost,ddp,n", [("pair", 1, False, 2), ("pair", 0, False, 2), ("replicas", 1, True, 2),
                                               ("parity:2", 1, False, 3)],
                         ids=["pair-lose-1", "pair-lose-0", "replicas-ddp", "parity"])
def test_restore_from_rebuilt_memory_without_reading_the_store(tmp_path: Path, scheme: str, lost: int,
                                                               ddp: bool, n: int) -> None:
    """The restarted job restores the newest rebuilt step (7) -- the lost
    rank's part from the rebuilt ring, the survivor's from its own, every
    chunk CRC-checked -- through ``cap.restore`` and ``cap.rewind`` while
    the store's chunk data is moved away: no chunk is read from the store,
    and every tensor is bit-exact against the unsharded reference. The
    steps are committed all the same."""
    nodes, recovered = lose_nodes(tmp_path, scheme, [lost], ddp=ddp, restore=True, n=n)
    got = recovered[0]["recovered"]
    assert isinstance(got, list) and {5, 6, 7} <= set(got), nodes.logs()
    assert_restored_unread(recovered, 7, nodes)
    check_bits(tmp_path, [0, *sorted(got)])
    assert dstt.open(tmp_path / "run").branch_info("main-rewind-7").parent == dstt.StepRef("main", 7)


@pytest.mark.slow
def test_none_loses_the_steps_and_names_them(tmp_path: Path) -> None:
    """Without redundancy the same loss takes rank 1's shards of steps 5-7:
    nothing wrong is committed, and one warning names the steps."""
    nodes, recovered = lose_node_after_protection(tmp_path, "none", lost=1)
    assert recovered[0]["recovered"] == [], nodes.logs()
    # (rank 0's ring may still hold older memory-only steps it had not evicted: named too)
    assert {5, 6, 7} <= named_steps(recovered[0]["warnings"]) <= set(range(1, 8))
    check_bits(tmp_path, [0])


@pytest.mark.slow
def test_pair_lose_node_zero(tmp_path: Path) -> None:
    """Rank 0's node lost: its shards rebuilt by node 1 (recorded as rank 0's, under rank 0's branch lock)."""
    nodes, recovered = lose_node_after_protection(tmp_path, "pair", lost=0)
    assert recovered[0]["recovered"] == [5, 6, 7], nodes.logs()
    check_bits(tmp_path, [0, 5, 6, 7])


@pytest.mark.slow
def test_pair_lose_a_node_while_copies_are_under_way(tmp_path: Path) -> None:
    """Lost right after the last snapshot (copies possibly not acknowledged):
    each of steps 5-7 is either rebuilt bit-exact or named as lost, never
    committed wrong."""
    nodes, recovered = lose_nodes(tmp_path, "pair", [1], nowait=True)
    got = set(recovered[0]["recovered"])  # type: ignore[call-overload]
    named = named_steps(recovered[0]["warnings"]) if recovered[0]["warnings"] else set()
    assert got <= set(range(8)) and not got & named, (got, named, nodes.logs())
    assert set(range(5, 8)) <= got | named, (got, named)  # each held step rebuilt or named
    committed = dstt.open(tmp_path / "run").steps()
    assert set(committed) - {0} == got - {0}
    check_bits(tmp_path, committed)


@pytest.mark.slow
def test_pair_recovery_killed_then_run_again(tmp_path: Path) -> None:
    """The restarted job is itself killed during its recovery; the next one
    finishes it: steps 5-7 committed once, bit-exact."""
    nodes, recovered = lose_nodes(tmp_path, "pair", [1], kill_recovery_after_s=4.0)
    check_bits(tmp_path, [0, 5, 6, 7])


@pytest.mark.slow
def test_pair_two_neighbours_lost_falls_back_and_names_the_steps(tmp_path: Path) -> None:
    """3 nodes, nodes 1 and 2 lost together: node 1's copies were on node 2,
    so its shards of steps 5-7 are gone (node 2's are rebuilt from node 0):
    nothing wrong committed, one warning names the steps."""
    nodes, recovered = lose_nodes(tmp_path, "pair", [1, 2], n=3)
    assert recovered[0]["recovered"] == [], nodes.logs()
    assert {5, 6, 7} <= named_steps(recovered[0]["warnings"]) <= set(range(1, 8))
    check_bits(tmp_path, [0])


@pytest.mark.slow
def test_pair_a_corrupted_copy_is_never_used(tmp_path: Path) -> None:
    """A bit of the copy of step 7 flipped on the node that keeps it: that
    copy is refused (named in a warning on its node), step 7 is not
    committed and is named; steps 5-6 are rebuilt bit-exact."""
    nodes, recovered = lose_nodes(tmp_path, "pair", [1], corrupt=True)
    assert recovered[0]["recovered"] == [5, 6], nodes.logs()
    assert 7 in named_steps([w for w in recovered[0]["warnings"] if "were held" in w])  # type: ignore[union-attr]
    assert any("is not used" in w and "CRC" in w for w in recovered[0]["warnings"])  # type: ignore[union-attr]
    check_bits(tmp_path, [0, 5, 6])


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0])
def test_replicas_ddp_two_nodes_lose_one_after_the_seal(tmp_path: Path, lost: int) -> None:
    """``replicas``, 2 nodes x 1 rank, the state replicated (DDP): node
    ``lost`` lost once its tier holds steps 5-7; the other node's ring holds
    every chunk of them (its own and the lost rank's share), so the
    restarted job rebuilds the lost rank's part of each from it and commits
    them, bit-exact against the unsharded reference, verify-clean. (Older
    memory-only steps whose seals the survivor's ring still holds are
    rebuilt and committed too: every step it sealed.) While training, the
    held steps are shown protected (each rank's seal holds the other's
    part): ``dstt ls`` says so."""
    seen: list[dict[str, object]] = []
    nodes, recovered = lose_nodes(tmp_path, "replicas", [lost], ddp=True, seen=seen, ls=True)
    assert_protected_while_training(seen, "replicas", nodes)
    got = recovered[0]["recovered"]
    assert isinstance(got, list) and {5, 6, 7} <= set(got) <= set(range(1, 8)), nodes.logs()
    assert recovered[0]["warnings"] == []
    check_bits(tmp_path, [0, *sorted(got)])


@pytest.mark.slow
def test_replicas_a_corrupted_replica_chunk_is_refused(tmp_path: Path) -> None:
    """A bit of a chunk node 0 holds for rank 1 flipped in its ring after
    step 7's seal: that chunk does not match the CRC sealed with it, so
    rank 1's step 7 is not rebuilt (named); steps 5-6 are, bit-exact."""
    nodes, recovered = lose_nodes(tmp_path, "replicas", [1], ddp=True, corrupt=True)
    got = recovered[0]["recovered"]
    assert isinstance(got, list) and {5, 6} <= set(got) <= set(range(1, 7)), nodes.logs()
    warned = recovered[0]["warnings"]
    assert 7 in named_steps([w for w in warned if "were held" in w])  # type: ignore[union-attr]
    assert any("not rebuilt from replicas" in w and "step 7" in w for w in warned)  # type: ignore[union-attr]
    check_bits(tmp_path, [0, *sorted(got)])


@pytest.mark.slow
@pytest.mark.parametrize("ddp", [True, False], ids=["ddp", "fsdp"])
def test_auto_chooses_replicas_for_replicated_state_else_pair(tmp_path: Path, ddp: bool) -> None:
    """``redundancy="auto"``: DDP's state (replicated on both nodes) gets
    ``replicas``, FSDP's (each shard on one node) ``pair``; rank 0 records
    the choice in the store; either way the lost node's steps 5-7 are
    rebuilt and committed bit-exact."""
    from dstt.format import replicas as RP
    from dstt.format.backends import open_backend

    chosen: list[object] = []
    nodes, recovered = lose_nodes(tmp_path, "auto", [1], ddp=ddp, chosen=chosen)
    want = "replicas" if ddp else "pair"
    assert chosen == [want, want], nodes.logs()
    doc = RP.read_choice(open_backend(str(tmp_path / "run"), create=False), "main")
    assert doc is not None and doc["redundancy"] == want and doc["step"] == 0
    got = recovered[0]["recovered"]
    assert isinstance(got, list) and {5, 6, 7} <= set(got), nodes.logs()
    assert recovered[0]["warnings"] == []
    check_bits(tmp_path, [0, *sorted(got)])


@pytest.mark.slow
def test_replicas_hsdp_two_nodes_of_two_ranks_lose_one(tmp_path: Path) -> None:
    """``replicas``, 2 nodes x 2 ranks, HSDP (sharded within a node,
    replicated across the two): node 1 (ranks 2-3) lost; rank 0's ring holds
    rank 2's whole shard, rank 1's rank 3's, so both parts of every held
    step are rebuilt -- each by a different survivor -- bit-exact."""
    nodes, recovered = lose_nodes(tmp_path, "replicas", [1], per=2, state="hsdp")
    got = recovered[0]["recovered"]
    assert isinstance(got, list) and {5, 6, 7} <= set(got) <= set(range(1, 8)), nodes.logs()
    assert recovered[0]["warnings"] == []
    check_bits(tmp_path, [0, *sorted(got)])


@pytest.mark.slow
def test_replicas_a_lost_part_assembled_from_several_survivors(tmp_path: Path) -> None:
    """``replicas``, 4 nodes x 1 rank, two tensors replicated crosswise
    (node_ranks.Crossed): the lost rank 3 shares one tensor's shard with
    rank 1 and the other's with rank 2, so no survivor holds its whole part.
    Its part of each held step is assembled from both survivors' rings (each
    chunk's CRC compared across its holders), committed bit-exact, and the
    newest step restored from that rebuilt memory without reading the
    store. While training, the held steps were shown protected."""
    seen: list[dict[str, object]] = []
    nodes, recovered = lose_nodes(tmp_path, "replicas", [3], n=4, state="crossed", restore=True, seen=seen,
                                  ls=True)
    assert_protected_while_training(seen, "replicas", nodes)
    got = recovered[0]["recovered"]
    assert isinstance(got, list) and {5, 6, 7} <= set(got) <= set(range(1, 8)), nodes.logs()
    assert all(r["warnings"] == [] for r in recovered), recovered
    check_bits(tmp_path, [0, *sorted(got)])
    assert_restored_unread(recovered, 7, nodes)


# ----------------------------------------------------------------------------- parity:k (3 nodes, parity:2)


def no_parity_left(nodes: Nodes) -> bool:
    return not any(f for node in range(nodes.n) if nodes.shm(node).exists() for f in nodes.shm(node).rglob("*.par"))


@pytest.mark.slow
def test_parity_three_nodes_lose_a_data_node_after_the_parity(tmp_path: Path) -> None:
    """``parity:2`` over 3 nodes: node 1 lost once every held step's parity
    is complete; the restarted job rebuilds rank 1's images of steps 5-7 by
    XOR from nodes 0 and 2 (their images and parities) and commits them,
    bit-exact. Stripes and the recovery's parts went point to point (the
    replacement joined the recovery's group): the store never held one."""
    watch = Watched()
    with StoreWatch(watch.see) as store:
        nodes, recovered = lose_nodes(tmp_path, "parity:2", [1], n=3, env={"DSTT_REDUNDANCY_STORE": store.addr})
    assert recovered[0]["recovered"] == [5, 6, 7], nodes.logs()
    assert all(r["warnings"] == [] for r in recovered), recovered
    check_bits(tmp_path, [0, 5, 6, 7])
    assert no_parity_left(nodes)
    assert not watch.blocks and watch.largest < 4096, (watch.blocks, watch.largest)
    assert len(watch.rang) == 2 and any(r.startswith("recover-") for r in watch.rang), watch.rang


@pytest.mark.slow
def test_parity_lose_node_zero(tmp_path: Path) -> None:
    """Node 0 lost: rank 0 (the commit's coordinator, on the node hosting the
    job's store) and the parity it held of nodes 1 and 2's stripes. Their
    data is intact (nothing of theirs to rebuild); rank 0's images of steps
    5-7 are rebuilt on the replacement from nodes 1 and 2, bit-exact."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2", [0], n=3)
    assert recovered[0]["recovered"] == [5, 6, 7], nodes.logs()
    assert all(r["warnings"] == [] for r in recovered), recovered
    check_bits(tmp_path, [0, 5, 6, 7])
    assert no_parity_left(nodes)


@pytest.mark.slow
def test_parity_lose_a_node_during_the_parity_update(tmp_path: Path) -> None:
    """Node 2 lost right after the last snapshot (stripes possibly in the
    mailbox, parities incomplete): each of steps 5-7 is either rebuilt
    bit-exact or named as lost, never committed wrong."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2", [2], n=3, nowait=True)
    got = set(recovered[0]["recovered"])  # type: ignore[call-overload]
    named = named_steps([w for w in recovered[0]["warnings"] if "were held" in w]) \
        if any("were held" in w for w in recovered[0]["warnings"]) else set()  # type: ignore[union-attr]
    assert got <= set(range(8)) and not got & named, (got, named, nodes.logs())
    assert set(range(5, 8)) <= got | named, (got, named)
    committed = dstt.open(tmp_path / "run").steps()
    assert set(committed) - {0} == got - {0}
    check_bits(tmp_path, committed)


@pytest.mark.slow
def test_parity_two_nodes_of_a_group_lost_falls_back_and_names_the_steps(tmp_path: Path) -> None:
    """Nodes 1 and 2 lost together (one parity covers one loss a group):
    nothing is rebuilt or committed wrong, and one warning names steps 5-7."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2", [1, 2], n=3)
    assert recovered[0]["recovered"] == [], nodes.logs()
    assert {5, 6, 7} <= named_steps(recovered[0]["warnings"]) <= set(range(1, 8))
    check_bits(tmp_path, [0])
    assert no_parity_left(nodes)


@pytest.mark.slow
def test_parity_a_node_lost_before_the_seal(tmp_path: Path) -> None:
    """Steps 0-7 protected, then node 1 lost while step 8 is being copied
    into its ring (its seal never written; nodes 0 and 2 sealed it): step 8
    is not restored, not even in part (no rank's chunks of it committed) and
    is named; the protected steps the survivors still hold are rebuilt and
    committed, bit-exact."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2", [1], n=3, stall=8, steps=9)
    got = recovered[0]["recovered"]
    assert 8 not in got and {6, 7} <= set(got) <= {5, 6, 7}, nodes.logs()  # type: ignore[operator, arg-type]
    assert 8 in named_steps(recovered[0]["warnings"])
    committed = dstt.open(tmp_path / "run").steps()
    assert committed == [0, *got]  # type: ignore[misc]
    check_bits(tmp_path, committed)
