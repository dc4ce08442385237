"""The demo router: least-loaded choice and exactly-once request bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl.core.directory import Announcement
from hixl.demo.router import Attempt, Ledger, choose


def ann(name: str, capacity: int, role: str = "decode") -> Announcement:
    return Announcement(
        name=name, role=role, engine="10.0.0.1:5000", gid="::1", mtu=1024, capacity=capacity
    )


def test_choose_least_loaded() -> None:
    members = {
        "d1": ann("d1", 4),
        "d2": ann("d2", 6),
        "p1": ann("p1", 100, role="prefill"),
    }
    assert choose(members) == "d2"
    assert choose(members, inflight={"d2": 3}) == "d1"  # 4 free vs 3 free
    assert choose(members, inflight={"d2": 2}) == "d1"  # a tie goes to the lowest name
    assert choose(members, exclude={"d2"}) == "d1"
    assert choose(members, inflight={"d1": 4, "d2": 6}) is None  # nobody has room
    assert choose(members, role="prefill") == "p1"
    assert choose({}) is None


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 20), max_size=6),
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 20), max_size=6),
    st.sets(st.sampled_from("abcdef")),
)
def test_choice_has_the_most_free_capacity(
    caps: dict[str, int], inflight: dict[str, int], exclude: set[str]
) -> None:
    members = {n: ann(n, c) for n, c in caps.items()}
    pick = choose(members, inflight=inflight, exclude=exclude)
    free = {n: c - inflight.get(n, 0) for n, c in caps.items() if n not in exclude}
    if pick is None:
        assert all(f <= 0 for f in free.values())
    else:
        assert pick not in exclude and free[pick] > 0
        assert free[pick] == max(free.values())


OPS = st.lists(
    st.tuples(
        st.sampled_from(["assign", "complete", "fail", "lost", "stale"]),
        st.sampled_from(["w1", "w2", "w3"]),
        st.integers(0, 7),
    ),
    max_size=80,
)


@given(OPS)
def test_every_request_completes_exactly_once(ops: list[tuple[str, str, int]]) -> None:
    """Whatever fails, and whatever late answers arrive, driving the ledger to the end
    completes every request exactly once, each by the attempt that was current."""
    requests = list(range(8))
    ledger = Ledger(requests)
    history: list[Attempt] = []
    completions: list[int] = []
    for op, worker, pick in ops:
        running = ledger.running()
        if op == "assign":
            req = ledger.next_pending()
            if req is not None:
                history.append(ledger.assign(req, worker))
        elif op == "complete" and running:
            a = running[pick % len(running)]
            assert ledger.complete(a)
            completions.append(a.request)
        elif op == "fail" and running:
            assert ledger.fail(running[pick % len(running)])
        elif op == "lost":
            before = {a.request for a in running if a.worker == worker}
            assert set(ledger.worker_lost(worker)) == before
        elif op == "stale" and history:
            # A late answer from an old attempt: accepted only if it is still current.
            a = history[pick % len(history)]
            current = a in ledger.running()
            assert ledger.complete(a) is current
            if current:
                completions.append(a.request)
        done, running_now = set(ledger.done()), {a.request for a in ledger.running()}
        assert not done & running_now
        assert len(ledger.running()) == len(running_now)  # one attempt per request at most
    # Drive to the end on one surviving worker.
    while not ledger.finished:
        req = ledger.next_pending()
        if req is None:
            for a in ledger.running():
                assert ledger.complete(a)
                completions.append(a.request)
            continue
        a = ledger.assign(req, "w9")
        assert ledger.complete(a)
        completions.append(a.request)
    assert sorted(completions) == requests
    assert sorted(ledger.done()) == requests
    assert sum(ledger.inflight().values()) == 0


def test_a_stale_attempt_cannot_complete_or_fail() -> None:
    ledger = Ledger([0])
    first = ledger.assign(0, "w1")
    assert ledger.worker_lost("w1") == [0] and ledger.retries == 1
    second = ledger.assign(0, "w2")
    assert second.number == 2
    assert not ledger.complete(first) and not ledger.fail(first)
    assert ledger.complete(second) and not ledger.complete(second)
    with pytest.raises(ValueError, match="not pending"):
        ledger.assign(0, "w3")


def test_check_results_finds_missing_and_duplicated() -> None:
    from hixl.demo.fleet import check_results

    def res(decode: str, ok: bool = True) -> dict[str, object]:
        return {"decode": decode, "ok": ok, "tokens": [1]}

    good = [
        {"results": {"0": res("d0"), "2": res("d1")}, "retries": 1},
        {"results": {"1": res("d1")}, "retries": 0},
    ]
    s = check_results(3, good)
    assert s["all_ok"] and s["retries"] == 1 and s["per_decode"] == {"d0": 1, "d1": 2}
    dup = [{"results": {"0": res("d0")}, "retries": 0}, {"results": {"0": res("d1")}, "retries": 0}]
    s = check_results(2, dup)
    assert s["duplicated"] == [0] and s["missing"] == [1] and not s["all_ok"]
    bad = [{"results": {"0": res("d0", ok=False)}, "retries": 0}]
    assert not check_results(1, bad)["all_ok"]
