"""A session's kept versions (`engine/history.py`): every kept version reads back as it was
committed, through appends, cuts, shifts, rollbacks and the oldest being forgotten, across
the versions kept whole; and through a session, an old version is rendered as it was."""

from __future__ import annotations

import random

import pytest

from prepos.engine.history import CHECKPOINT, History


def _msg(i: int) -> dict:
    return {"role": "user", "content": f"line {i}"}


@pytest.mark.parametrize("seed", range(4))
def test_every_kept_version_reads_back_as_committed(seed):
    rng = random.Random(seed)
    keep = 3 * CHECKPOINT // 2
    hist, ref, cur = History(keep), {}, [{"role": "system", "content": "s"}]
    hist.add(0, cur)
    ref[0] = tuple(cur)
    for v in range(1, 4 * CHECKPOINT + 7):
        op = rng.random()
        if op < 0.6:  # an append
            cur = [*cur, _msg(v)]
        elif op < 0.75 and len(cur) > 2:  # a shift: the oldest data dropped
            cur = [cur[0], *cur[2:]]
        elif op < 0.9:  # a rollback to a kept version
            cur = list(ref[rng.choice(sorted(ref))])
        else:  # equal messages that are other objects (a journal's)
            cur = [dict(m) for m in cur] + [_msg(v)]
        hist.add(v, cur)
        ref[v] = tuple(cur)
        for old in [k for k in ref if k <= v - keep]:
            del ref[old]
        assert sorted(hist) == sorted(ref) and len(hist) == len(ref)
        probe = rng.choice(sorted(ref))
        assert hist.messages(probe) == ref[probe]
    assert hist.all() == ref
    assert list(hist.all()) == sorted(ref)
    assert 0 not in hist


def test_an_old_version_is_rendered_when_read_or_rolled_back_to(make_engine):
    eng = make_engine("chatml", max_versions=CHECKPOINT + 5)
    sid = eng.create_session("streaming", system="Prices.")
    snaps = {}
    for i in range(CHECKPOINT + 20):
        v = eng.append(sid, f"ACME {i}", wait=False)
        snaps[v] = eng.snapshot(sid)
    kept = eng.versions(sid)
    assert len(kept) == CHECKPOINT + 5 and min(kept) == max(snaps) - CHECKPOINT - 4
    for v in (min(kept), min(kept) + 1, max(kept) - 1):
        assert eng.snapshot(sid, v) == snaps[v]
    new = eng.rollback(sid, min(kept), wait=False)
    now = eng.snapshot(sid)
    assert now.version == new and (now.messages, now.text, now.tokens) == (
        snaps[min(kept)].messages, snaps[min(kept)].text, snaps[min(kept)].tokens)
