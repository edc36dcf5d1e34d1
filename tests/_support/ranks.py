"""Real ranks for multi-rank tests: one subprocess per rank, joined by a gloo process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def run_ranks(
    worker: str,
    scenario: str,
    world: int,
    tmp_path: Path,
    root: str,
    timeout: float = 150,
    args: object = None,
) -> list[dict]:
    """Run ``tests/WORKER SCENARIO RANK WORLD STORE ROOT OUT [ARGS]`` once per rank; return what
    each rank wrote to OUT. ``args`` travels as JSON. Fails unless every rank exits 0."""
    store = tmp_path / f"store-{scenario}-{world}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"{scenario}-{world}-{rank}.json"
        outs.append(out)
        cmd = [sys.executable, str(TESTS / worker), scenario, str(rank), str(world), str(store)]
        cmd += [root, str(out), json.dumps(args)]
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world, f"rank exit codes {codes}"
    return [json.loads(o.read_text()) for o in outs]


def serve_rank(scenarios: dict, *, with_args: bool = True) -> None:
    """The body of a worker module: ``SCENARIO RANK WORLD STORE ROOT OUT [ARGS]`` from argv;
    joins the gloo group, runs ``scenarios[SCENARIO](rank, world, root[, args])`` under anyio
    and writes its result to OUT as JSON."""
    import anyio
    import torch.distributed as dist

    scenario, rank, world, store, root, out = sys.argv[1:7]
    extra = [json.loads(sys.argv[7]) or {}] if with_args else []
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=w)
    try:
        result = anyio.run(scenarios[scenario], r, w, root, *extra)
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))
    # Done: leave without the interpreter's teardown. torch's gloo process groups, still held
    # by the device-mesh registry after destroy_process_group, now and then abort a process
    # as they are destroyed at exit ("terminate called without an active exception",
    # SIGABRT): 3 runs in 30 of a 2-rank FSDP worker that never opened a manager.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
