"""The run token: agents started together on one run directory all read the same, complete token."""

from __future__ import annotations

import multiprocessing
import stat

from resilient.agent.rundir import ensure_token


def _race(path: str, start, out) -> None:  # a separate process, as two agents are
    from pathlib import Path

    start.wait()
    try:
        out.put(ensure_token(Path(path)))
    except Exception as e:  # noqa: BLE001  the parent reports what went wrong
        out.put(f"error: {type(e).__name__}: {e}")


def test_agents_racing_to_create_the_token_all_get_the_one_complete_token(tmp_path) -> None:
    ctx = multiprocessing.get_context("fork")
    for attempt in range(20):
        path = tmp_path / f"run{attempt}" / "token"
        path.parent.mkdir()
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(str(path), start, out)) for _ in range(6)]
        for p in procs:
            p.start()
        start.set()
        got = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        assert len(set(got)) == 1 and len(got[0]) == 64, got
        assert path.read_text().strip() == got[0]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert [p.name for p in path.parent.iterdir()] == ["token"], "no temporary file is left behind"
