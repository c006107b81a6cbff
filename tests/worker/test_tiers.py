"""KV tiers: sessions are bounded by the tiers, not by the back end's cells or sequences. A
session whose KV moved down (host RAM, disk, or nowhere: recomputed from its committed
tokens) is served again as if it had stayed (exact on torch, the argmax within the stated
tolerance on llama.cpp); only a foreground request moves other sessions' KV down, and never
one a task is using; idle work moves nobody's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from prepos.config import BudgetConfig, TierConfig
from prepos.core import Request, SamplingParams
from prepos.errors import OverBudget
from prepos.worker.sequence import Forward
from tests.support.helpers import greedy_agrees, hold_worker

GREEDY = Request(SamplingParams(max_tokens=4), fast_path="off")
SYSTEM = "Live prices. Answer in one word: up, down or flat."


def small(make_engine, tiers: TierConfig | None = None, cells: int = 160, **config):
    """An engine whose resident budget holds about two sessions (and, on llama.cpp, four
    sequences)."""
    return make_engine("chatml", budget=BudgetConfig(session_cells=4096, engine_cells=cells),
                       max_sequences=4, **({"tiers": tiers} if tiers else {}), **config)


def entry(eng, sid, question):
    snap = eng.snapshot(sid)
    frame = eng.fmt.frame(eng.session(sid).entries(snap).user, question)
    return list(snap.tokens) + eng.fmt.encode(frame)


def answers_as_cold(eng, seq, res) -> bool:
    return all(greedy_agrees(eng, list(seq) + res.tokens[:i], t)
               for i, t in enumerate(res.tokens))


def fill(eng, n: int) -> list[str]:
    sids = []
    for i in range(n):
        sid = eng.create_session("streaming", system=SYSTEM)
        eng.append(sid, f"ACME {40 + i} {41 + i} {43 + i} BOLT {9 - i % 3}")
        sids.append(sid)
    return sids


def test_more_sessions_than_the_back_end_holds_each_answer_as_cold(make_engine):
    eng = small(make_engine)
    sids = fill(eng, 10)
    for sid in sids:
        seq = entry(eng, sid, "Which way is ACME moving?")
        res = eng.query(sid, "Which way is ACME moving?", GREEDY).result()
        assert answers_as_cold(eng, seq, res)
    tiers = [eng.info(sid)["kv"] for sid in sids]
    assert "ram" in tiers and tiers.count("resident") <= 4
    m = eng.metrics()["kv_tiers"]
    assert m["spills"] > 0 and m["restores"] > 0 and m["recomputed_tokens"] == 0
    assert m["resident"]["cells"] <= 160


@pytest.mark.parametrize("predecode", [0, 64])
def test_a_restored_kv_answers_as_before_and_from_its_prepositioned_entry(make_engine,
                                                                          predecode):
    eng = small(make_engine, predecode_tokens=predecode)
    a = eng.create_session("streaming", system=SYSTEM, standing=["Up?"])
    eng.append(a, "ACME 41 43 44 47")
    eng.wait_idle()
    before = eng.query(a, "Up?", Request(SamplingParams(max_tokens=4))).result()
    fill(eng, 4)  # a's KV moves down
    assert eng.info(a)["kv"] != "resident"
    after = eng.query(a, "Up?", Request(SamplingParams(max_tokens=4))).result()
    assert after.path == before.path and after.tokens == before.tokens  # the record survived
    if predecode:  # the whole answer was pre-decoded: served without its KV
        assert after.predecoded == len(after.tokens) and eng.info(a)["kv"] != "resident"
    else:  # tokens after the first decode on from the KV, brought back
        assert after.predecoded == 0 and eng.info(a)["kv"] == "resident"


@pytest.mark.parametrize("tiers, lands", [
    (TierConfig(ram_bytes=1, disk_bytes=1 << 30), "disk"),  # RAM holds nothing: disk
    (TierConfig(ram_bytes=1, disk_bytes=1), "none"),  # no tier holds it: recomputed
])
def test_below_ram_disk_then_recompute(make_engine, tiers, lands):
    eng = small(make_engine, tiers)
    sids = fill(eng, 6)
    assert lands in [eng.info(sid)["kv"] for sid in sids]
    for sid in sids:
        seq = entry(eng, sid, "Is BOLT up?")
        assert answers_as_cold(eng, seq, eng.query(sid, "Is BOLT up?", GREEDY).result())
    m = eng.metrics()["kv_tiers"]
    if lands == "disk":
        assert m["moves"]["disk"] > 0 and m["restores"] > 0
    else:
        assert m["moves"]["dropped"] > 0 and m["recomputed_tokens"] > 0


def test_idle_work_moves_no_committed_kv_down(make_engine):
    eng = small(make_engine, cells=100)
    a, b = fill(eng, 2)  # b's commit moved a's KV down
    assert eng.info(a)["kv"] != "resident" and eng.info(b)["kv"] == "resident"
    spills = eng.metrics()["kv_tiers"]["spills"]
    failed = []

    def idle_forward():  # idle work that would need a's KV back
        yield Forward(eng.pool.get(a), entry(eng, a, "Up?"))

    task = eng.scheduler.submit(idle_forward(), idle=True, key=a, on_error=failed.append)
    task.done.wait(30)
    assert failed and isinstance(failed[0], OverBudget)
    assert eng.info(b)["kv"] == "resident"
    assert eng.metrics()["kv_tiers"]["spills"] == spills


def test_a_session_larger_than_the_resident_budget_is_refused_unchanged(make_engine):
    eng = small(make_engine, cells=60)
    sid = eng.create_session("streaming", system=SYSTEM)
    before = eng.snapshot(sid)
    with pytest.raises(OverBudget):
        eng.append(sid, "ACME " + " ".join(str(i) for i in range(60)))
    assert eng.snapshot(sid) == before


def _peak_cells(eng) -> list[int]:
    """The most resident cells the pool ever counted, from now on (one-element list)."""
    peak, resize = [eng.pool.used], eng.pool._resize

    def counting(delta: int) -> None:
        resize(delta)
        peak[0] = max(peak[0], eng.pool.used)

    eng.pool._resize = counting
    for kv in eng.pool._kv.values():
        kv._on_size = counting
    return peak


@pytest.mark.parametrize("asked", [3, 6])
def test_concurrent_requests_over_a_full_budget_are_served_within_it(make_engine, backend,
                                                                    asked):
    """Requests that arrive together, whose cells together exceed the resident budget (3 of
    6 sessions asked: the others' KV must move down for their sum; all 6: not all of them
    fit at once): a batch makes room for the sum of its forwards (idle sessions' KV moved
    down), what still does not fit waits for the next quantum, and none is refused
    (invariant 3). Each answer is the cold one; the resident cells never exceed the
    budget."""
    cells = 256
    fixed = {} if backend.endswith("/streams") else {"kv_cells": cells}  # llama.cpp's cache
    eng = make_engine("chatml", budget=BudgetConfig(session_cells=4096, engine_cells=cells),
                      max_sequences=8, **fixed)
    sids = [eng.create_session("streaming", system=SYSTEM, preposition=False)
            for _ in range(6)]
    for i, sid in enumerate(sids):  # ~60 tokens each: more than the budget holds
        eng.append(sid, f"ACME {40 + i} {41 + i} {43 + i} BOLT {9 - i % 3}")
    peak = _peak_cells(eng)
    question = "Which way is ACME moving? Say it in one word, then why."
    seqs = {sid: entry(eng, sid, question) for sid in sids}
    gate = hold_worker(eng, 300)
    streams = {sid: eng.query(sid, question, Request(SamplingParams(max_tokens=12),
                                                     fast_path="off"))
               for sid in sids[-asked:]}
    gate.set()
    results = {sid: stream.result(timeout=600) for sid, stream in streams.items()}
    assert peak[0] <= cells and eng.metrics()["kv_tiers"]["resident"]["cells"] <= cells
    for sid in sids:  # the cold references need cells of their own
        eng.close_session(sid)
    for sid, res in results.items():
        assert res.finish_reason in ("stop", "length") and res.tokens
        assert answers_as_cold(eng, seqs[sid], res)


def test_idle_work_brings_a_spilled_session_back_only_where_it_is_asked(make_engine):
    """A pre-position that needs a KV moved down brings it back (into free room) only when
    the session's h(rho) reaches predecode_min_hit: updates nobody asks about are not worth
    a restore."""
    eng = small(make_engine, cells=100, predecode_min_hit=0.2)
    a, b = fill(eng, 2)  # b's commit moved a's KV down
    assert eng.wait_idle(60) and eng.info(a)["kv"] != "resident"
    eng.close_session(b)  # room for a again
    s, rate = eng.session(a), eng.prepositioner.predecoder.rate
    for _ in range(8):
        rate.update(s)  # updates nobody asked about: h(rho) below 0.2
    skipped = eng.prepositioner.counters.skipped
    eng.append(a, "ACME 50", wait=False)  # committed; its KV left where it was
    assert eng.wait_idle(60)
    assert eng.info(a)["kv"] != "resident" and not eng.ready_now(a)[1]
    assert eng.prepositioner.counters.skipped == skipped + 1
    for _ in range(8):
        rate.asked(s)  # now it is asked about
    eng.append(a, "ACME 51", wait=False)
    assert eng.wait_idle(60)
    assert eng.info(a)["kv"] == "resident" and eng.ready_now(a)[1]


def test_an_implicit_session_moves_down_a_tier_and_comes_back(make_engine):
    """A session kept for a stock client (implicit) counts for no budget, yet with tiers its
    KV moves down as any other's under pressure, and its next turn restores it."""
    from prepos.engine.session_spec import SessionSpec

    eng = small(make_engine, cells=100)
    imp = eng.restore_session("implicit-1", SessionSpec("agentic", SYSTEM, implicit=True))
    eng.add_message(imp, "user", "ACME 40 41 43 BOLT 9. Up or down?")
    assert eng.wait_idle(60) and eng.info(imp)["kv"] == "resident"
    fill(eng, 2)  # others' commits need the room
    assert eng.wait_idle(60) and eng.info(imp)["kv"] in ("ram", "disk")
    restores = eng.metrics()["kv_tiers"]["restores"]
    res = eng.turn(imp, None, GREEDY).result()
    assert res.tokens and eng.metrics()["kv_tiers"]["restores"] == restores + 1


@pytest.mark.parametrize("idle_cells", [0, None])
def test_idle_kvs_leave_the_scanned_cells_while_a_request_runs(make_engine, idle_cells):
    """Where every forward scans every resident cell (llama.cpp's unified layout), a
    foreground request runs with the idle sessions' KV beyond `kv_idle_cells` moved down a
    tier, and a session moved so answers as cold when it comes back; with no bound (None),
    or where forwards scan their own cells only, idle KVs stay resident."""
    eng = make_engine("chatml", kv_idle_cells=idle_cells)
    moves = idle_cells is not None and eng.backend.scans_resident
    idle = "ram" if moves else "resident"
    a, b = fill(eng, 2)
    for asked, other in ((a, b), (b, a)):
        eng.wait_idle()  # the pre-positions done (idle work may bring a KV back)
        seq = entry(eng, asked, "Which way is ACME moving?")
        res = eng.query(asked, "Which way is ACME moving?", GREEDY).result()
        assert answers_as_cold(eng, seq, res)
        eng.wait_idle()
        assert (eng.info(asked)["kv"], eng.info(other)["kv"]) == ("resident", idle)
    assert (eng.metrics()["kv_tiers"]["restores"] > 0) == moves


def test_idle_kvs_move_down_before_a_returning_kv_is_placed(make_engine, monkeypatch):
    """A forward on llama.cpp's unified layout scans every cell up to the highest in use,
    and a KV coming back is placed in the first free cells: so the idle KVs a request moves
    out of its forward's way move down before its own KV is loaded, not after (else it
    would sit above their freed cells and be scanned as if they had stayed). Where forwards
    scan their own cells only, the idle KV stays. Read from the back end's own calls, in
    the order they ran."""
    eng = make_engine("chatml", kv_idle_cells=0)
    a, b = fill(eng, 2)
    eng.wait_idle()
    eng.query(b, "Which way is ACME moving?", GREEDY).result()
    eng.wait_idle()
    scans = eng.backend.scans_resident
    assert (eng.info(a)["kv"], eng.info(b)["kv"]) == ("ram" if scans else "resident",
                                                      "resident")
    held = eng.pool._kv[b].handle
    calls: list[tuple[str, object]] = []

    def spy(name):
        real = getattr(eng.backend, name)

        def call(*args, **kwargs):
            calls.append((name, args[0] if args else None))
            return real(*args, **kwargs)
        return call

    for name in ("load", "new_kv", "release"):
        monkeypatch.setattr(eng.backend, name, spy(name))
    eng.query(a, "Is BOLT up?", GREEDY).result()
    placed = [i for i, (name, _) in enumerate(calls) if name in ("load", "new_kv")]
    moved = [i for i, (name, h) in enumerate(calls) if name == "release" and h is held]
    if scans:
        assert placed and moved and moved[0] < placed[0]
    else:
        assert not moved and eng.info(b)["kv"] == "resident"


def _spilled_to_disk(make_engine):
    """An engine with sessions a and b, a's KV on disk (RAM holds nothing), b resident, and
    room for a to come back without moving anyone (idle KVs left resident while a request
    runs: only a move for room would move b)."""
    eng = small(make_engine, TierConfig(ram_bytes=1, disk_bytes=1 << 30), kv_idle_cells=None)
    sids = fill(eng, 3)
    assert eng.wait_idle(60)
    where = {sid: eng.info(sid)["kv"] for sid in sids}
    a = next(sid for sid in sids if where[sid] == "disk")
    b, c = (sid for sid in sids if where[sid] == "resident")
    eng.close_session(c)
    assert eng.wait_idle(60) and eng.info(b)["kv"] == "resident"
    return eng, a, b


@pytest.mark.parametrize("damage", ["gone", "unreadable", "garbage"])
def test_a_lost_disk_state_is_recomputed_and_moves_nobody(make_engine, damage):
    """A session whose disk-tier file is gone, cannot be read (a directory in its place) or
    holds no state is recomputed from its tokens: its answers are the cold ones, now and
    after, and no other session moves for it."""
    eng, a, b = _spilled_to_disk(make_engine)
    path = eng.pool.tiers.dir / f"{a}.kv"
    path.unlink()
    if damage == "unreadable":
        path.mkdir()
    elif damage == "garbage":
        path.write_bytes(b"not a KV state" * 64)
    before = eng.metrics()["kv_tiers"]
    for question in ("Which way is ACME moving?", "Is BOLT up?"):
        seq = entry(eng, a, question)
        assert answers_as_cold(eng, seq, eng.query(a, question, GREEDY).result())
    m = eng.metrics()["kv_tiers"]
    assert m["spills"] == before["spills"] and eng.info(b)["kv"] == "resident"
    assert m["recomputed_tokens"] > before["recomputed_tokens"]
    files = {f.stem: f.stat().st_size for f in eng.pool.tiers.dir.glob("*.kv") if f.is_file()}
    # the lost file forgotten: the disk tier counts the files there are (copies saved since
    # at idle included)
    assert m["disk"]["sessions"] == len(files) and m["disk"]["bytes"] == sum(files.values())
    if damage != "garbage":  # read back as bytes, which the back end refused
        assert m["moves"]["unreadable"] == before["moves"]["unreadable"] + 1
    eng.append(a, "ACME 50 51")  # the session goes on
    seq = entry(eng, a, "Is BOLT up?")
    assert answers_as_cold(eng, seq, eng.query(a, "Is BOLT up?", GREEDY).result())


def test_a_lost_donor_state_is_skipped_and_moves_nobody(make_engine):
    """A new session whose prefix only a session on disk holds, that state's file gone: the
    new one is prefilled whole, nobody moves for it (idle KVs left resident while a request
    runs), and the donor is recomputed when asked."""
    eng = small(make_engine, TierConfig(ram_bytes=1, disk_bytes=1 << 30), kv_idle_cells=None)
    if eng.pool.index is None:
        pytest.skip("the back end shares no prefixes")
    data = "NOVA " + " ".join(str(100 + 7 * i) for i in range(10))
    d = eng.create_session("streaming", system=SYSTEM, preposition=False)
    eng.append(d, data)
    c0, b = fill(eng, 2)
    assert eng.wait_idle(60) and eng.info(d)["kv"] == "disk"
    eng.close_session(c0)
    assert eng.wait_idle(60)
    (eng.pool.tiers.dir / f"{d}.kv").unlink()
    before = eng.metrics()["kv_tiers"]
    c = eng.create_session("streaming", system=SYSTEM, preposition=False)
    eng.append(c, data)  # d's tokens: only d holds their second block
    m = eng.metrics()["kv_tiers"]
    assert m["moves"]["unreadable"] == before["moves"]["unreadable"] + 1
    assert m["spills"] == before["spills"] and m["prefix_loads"] == before["prefix_loads"]
    assert eng.info(b)["kv"] == "resident" and eng.info(d)["kv"] == "none"
    seq = entry(eng, d, "Is NOVA up?")
    assert answers_as_cold(eng, seq, eng.query(d, "Is NOVA up?", GREEDY).result())


def test_a_killed_process_kv_directory_is_removed_at_start(tmp_path):
    """KV directories left by processes that are gone (no lock held; an older one without a
    lock, its pid no process's) are removed and counted when tiers start in the same
    place; a living one's (its lock held) stays."""
    import subprocess
    import sys

    from prepos.worker.tiers import Tiers

    live = Tiers(1, 1 << 20, tmp_path)
    live.put("s", b"x" * 100)
    live.put("t", b"y" * 10)  # RAM holds one byte: both on disk
    assert live.sizes()["disk"]["sessions"] == 2
    code = ("import os, sys; sys.path.insert(0, sys.argv[2]); from prepos.worker.tiers import "
            "Tiers; t = Tiers(1, 1 << 20, sys.argv[1]); t.put('k', b'z' * 1000); "
            "t.put('l', b'w' * 20); os._exit(9)")  # killed: nothing cleaned up
    src = str(__import__("prepos").__path__[0].rsplit("/prepos", 1)[0])
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path), src]).returncode == 9
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = tmp_path / f"prepos-kv-{dead.pid}-abc"  # an older prepos's: no lock, its pid gone
    old.mkdir()
    (old / "m.kv").write_bytes(b"v" * 50)
    before = {p.name for p in tmp_path.iterdir()}
    assert len(before) == 3
    fresh = Tiers(1, 1 << 20, tmp_path)
    assert fresh.sizes()["disk"]["reclaimed"] == {"dirs": 2, "bytes": 1020 + 50}
    assert {p.name for p in tmp_path.iterdir()} == {live.dir.name, fresh.dir.name}
    assert live.peek("s") == b"x" * 100
    fresh.close()
    live.close()
    assert list(tmp_path.iterdir()) == []


def test_a_500_body_names_no_path_nor_the_exception(caplog):
    """An unexpected failure is a 500 whose body names a reference into the log, never the
    exception's text or a file path (the log has them)."""
    from prepos.server.http.errors import as_api_error

    err = as_api_error(FileNotFoundError(2, "No such file or directory", "/var/kv/s-1.kv"))
    assert err.status == 500 and err.code == "internal_error"
    assert "/var/kv" not in err.message and "FileNotFoundError" not in err.message
    assert "No such file" not in err.message and "reference" in err.message
    ref = err.message.split("reference ", 1)[1].split()[0]
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)


def test_over_http_a_lost_disk_state_answers_and_the_session_goes_on(model_dirs, tmp_path):
    """Through the server: a session whose disk-tier file was deleted is answered (200, the
    answer the same session gave before it moved down) and takes appends."""
    import httpx

    from tests.support.server_harness import ServerProc

    kv_dir = tmp_path / "kv"
    with ServerProc(model_dirs["chatml"], tmp_path / "srv", "--backend", "torch",
                    "--kv-ram", "1", "--kv-dir", str(kv_dir), "--max-kv-cells", "160",
                    "--no-preposition") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as http:
        sids, first = [], {}
        ask = {"question": "Which way is ACME moving?", "max_tokens": 4}
        for i in range(3):
            r = http.post("/sessions", json={"kind": "streaming", "system": SYSTEM})
            sid = r.json()["id"]
            sids.append(sid)
            assert http.post(f"/sessions/{sid}/append",
                             json={"data": f"ACME {40 + i} {41 + i} BOLT {9 - i}"}).is_success
            first[sid] = http.post(f"/sessions/{sid}/query", json=ask).json()["text"]
        on_disk = [s for s in sids if http.get(f"/sessions/{s}").json()["kv"] == "disk"]
        assert on_disk, [http.get(f"/sessions/{s}").json()["kv"] for s in sids]
        for path in kv_dir.glob("prepos-kv-*/*.kv"):
            path.unlink()
        for sid in on_disk:
            r = http.post(f"/sessions/{sid}/query", json=ask)
            assert r.status_code == 200 and r.json()["text"] == first[sid], r.text
            r = http.post(f"/sessions/{sid}/append", json={"data": "ACME 50"})
            assert r.status_code == 200, r.text
            assert http.post(f"/sessions/{sid}/query", json=ask).status_code == 200


def _move_down(eng, sid):
    """`sid`'s KV moved down a tier on the worker, as room-making moves an idle one."""
    pool, where = eng.pool, []
    assert eng.wait_idle(60)

    def move():
        kv = pool.find(sid)
        if kv is not None and kv.handle is not None:
            pool._spill(kv)
        where.append(pool.tier(sid))
        yield

    eng._call(move(), key=sid)
    assert where[0] in ("ram", "disk")


def test_a_kv_moved_down_keeps_its_speculative_cells(make_engine):
    """Moving a KV down loses nothing it holds: a KV brought back from a tier, then given
    speculative cells (a query's entry and answer, a pre-position), is copied whole once (at
    idle, or when it moves where idle time copies only the older KVs), keeps those cells
    when it moves down, moves down again saving nothing, and answers as cold when it comes
    back."""
    eng = small(make_engine)
    a = eng.create_session("streaming", system=SYSTEM)
    eng.append(a, "ACME 41 43 44 47")
    _move_down(eng, a)
    restores = eng.pool.counts["restores"]
    seq = entry(eng, a, "Which way is ACME moving?")
    assert answers_as_cold(eng, seq, eng.query(a, "Which way is ACME moving?", GREEDY).result())
    assert eng.pool.counts["restores"] == restores + 1 and eng.wait_idle(60)
    kv = eng.pool.find(a)
    held = list(kv.tokens)
    assert len(held) > len(eng.snapshot(a).tokens)  # speculative cells after the committed
    saves = eng.pool.counts["saves"]
    _move_down(eng, a)
    assert kv.tokens == held and eng.pool._saved[a] == len(held)
    assert eng.pool.counts["saves"] <= saves + 1

    def back():
        kv.ensure()  # resident again, from its copy
        yield

    eng._call(back(), key=a)
    assert kv.handle is not None and kv.tokens == held and kv.clean == len(held)
    m = dict(eng.pool.counts)
    _move_down(eng, a)
    assert eng.pool.counts["saves"] == m["saves"]
    assert eng.pool.counts["clean_moves"] == m["clean_moves"] + 1
    seq = entry(eng, a, "Is BOLT up?")
    assert answers_as_cold(eng, seq, eng.query(a, "Is BOLT up?", GREEDY).result())


def test_a_commit_makes_the_kept_copy_stale_and_it_is_saved_again(make_engine):
    """A commit after the restore goes beyond the tier's copy: it is saved again before
    the KV moves down (the copy then holds the new committed tokens) and it answers as
    cold."""
    eng = small(make_engine)
    a = eng.create_session("streaming", system=SYSTEM)
    eng.append(a, "ACME 41 43 44 47")
    _move_down(eng, a)
    eng.query(a, "Which way is ACME moving?", GREEDY).result()  # brought back
    assert eng.wait_idle(60)  # its answer's cells copied at idle
    saves = eng.pool.counts["saves"]
    eng.append(a, "BOLT 9 8 7")
    assert eng.wait_idle(60)
    _move_down(eng, a)
    assert eng.pool.counts["saves"] > saves  # at idle (each change idle time makes), or moved
    committed = len(eng.snapshot(a).tokens)
    assert eng.pool._saved[a] >= committed and eng.pool.find(a).clean >= committed
    seq = entry(eng, a, "Is BOLT up?")
    assert answers_as_cold(eng, seq, eng.query(a, "Is BOLT up?", GREEDY).result())


def test_after_idle_housekeeping_a_request_moves_idle_kvs_down_without_saving(make_engine):
    """Idle time saves copies of the idle KVs a request may move down and moves none of
    them; a foreground request that then needs their room (or, where every forward scans
    every resident cell, their cells out of its forward) moves them down saving nothing,
    and each answers as cold when it comes back."""
    eng = small(make_engine, kv_idle_cells=0)
    a, b = fill(eng, 2)
    assert eng.wait_idle(60) and eng.info(b)["kv"] == "resident"
    m = dict(eng.pool.counts)
    assert m["idle_saves"] > 0
    c = eng.create_session("streaming", system=SYSTEM, preposition=False)
    eng.append(c, "NOVA 100 107 114 121 128 135 142 149")  # a's room (torch), or its cells
    n = eng.pool.counts
    moved = n["spills"] - m["spills"]
    assert moved > 0 and n["clean_moves"] - m["clean_moves"] == moved
    assert n["saves"] - n["idle_saves"] == m["saves"] - m["idle_saves"]  # none in foreground
    for sid in (a, b):
        seq = entry(eng, sid, "Is BOLT up?")
        assert answers_as_cold(eng, seq, eng.query(sid, "Is BOLT up?", GREEDY).result())


# run in a fresh interpreter: a long-lived process's heaps may hold a free block large enough,
# which malloc reuses whatever the threshold
_BLOCKS = """
import ctypes, sys
from prepos.worker.tiers import map_large_blocks

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    sys.exit(3)
libc.mallinfo2.restype = Mallinfo2
fixed = sys.argv[1] == "fixed" and map_large_blocks()
big = bytearray(24 << 20)
del big
before = libc.mallinfo2().hblkhd  # bytes in mapped blocks
state = bytearray(9 << 20)
mapped = libc.mallinfo2().hblkhd - before
del state
print(fixed, mapped >> 20, (libc.mallinfo2().hblkhd - before) >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.parametrize("mode", ["fixed", "as_is"])
def test_a_state_block_is_mapped_alone_and_returned_when_freed(mode):
    """After a larger block was freed, glibc serves the next state's block from its heap (its
    threshold risen to the freed block's size), where freeing it returns nothing; with the
    tiers' fixed threshold it is mapped alone and unmapped when freed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own
    out = subprocess.run([sys.executable, "-c", _BLOCKS, mode], capture_output=True,
                         text=True, timeout=120, env=env)
    if out.returncode == 3:
        pytest.skip("glibc before 2.33 has no mallinfo2")
    assert out.returncode == 0, out.stderr
    fixed, mapped_mib, left_mib = out.stdout.split()
    if mode == "fixed":
        assert (fixed, int(mapped_mib), int(left_mib)) == ("True", 9, 0)
    else:  # what the tiers set it for: glibc alone keeps the block in its heap
        assert (fixed, int(mapped_mib)) == ("False", 0)


def test_a_prompt_longer_than_a_step_runs_beside_the_answers_moving_their_kv_down(make_engine,
                                                                               backend):
    """A prompt longer than a step's tokens runs in chunks beside the answers taken with it,
    and needs cells their resident KV holds: theirs moves down a tier (it comes back when
    they run next) and no request is refused (invariant 3). Each answer is the cold one."""
    cells = 1024
    fixed = {} if backend.endswith("/streams") else {"kv_cells": cells}  # llama.cpp's cache
    eng = make_engine("chatml", budget=BudgetConfig(session_cells=4096, engine_cells=cells),
                      max_sequences=8, kv_idle_cells=None, batch_tokens=512,
                      **fixed)  # idle KVs stay resident
    cap = eng.config.batch_tokens
    others = [eng.create_session("streaming", system=SYSTEM, preposition=False)
              for _ in range(3)]
    for i, sid in enumerate(others):  # about a quarter of the cells each, resident
        for k in range(5):
            eng.append(sid, f"ACME {40 + i + k} {41 + i} {43 + k} BOLT {9 - i % 3} {k}")
    long = eng.create_session("streaming", system=SYSTEM, preposition=False)
    eng.append(long, "ACME 40 41 43")
    words = " ".join(f"ACME {n} BOLT {n % 7}" for n in range(40))
    question = f"Which of these moved most? {words}"
    seqs = {long: entry(eng, long, question)}
    seqs.update({sid: entry(eng, sid, "Which way is ACME moving?") for sid in others})
    used = eng.pool.used
    assert len(seqs[long]) - len(eng.snapshot(long).tokens) > cap  # in chunks
    assert used + len(seqs[long]) > cells  # it fits only where the others' KV moves down
    assert max(map(len, seqs.values())) < cells
    gate = hold_worker(eng, 300)
    streams = {long: eng.query(long, question, Request(SamplingParams(max_tokens=4),
                                                       fast_path="off"))}
    for sid in others:  # taken with it, after it, into one quantum
        streams[sid] = eng.query(sid, "Which way is ACME moving?",
                                 Request(SamplingParams(max_tokens=8), fast_path="off"))
    gate.set()
    results = {sid: stream.result(timeout=600) for sid, stream in streams.items()}
    for sid in [*others, long]:  # the cold references need cells of their own
        eng.close_session(sid)
    for sid, res in results.items():
        assert res.finish_reason in ("stop", "length") and res.tokens
        assert answers_as_cold(eng, seqs[sid], res)
