"""Each scheduling policy on small hand-checkable scenarios with the fake engine: admission order, who is
preempted, the token-budget split, the starvation bound of aging, and user policies named as `module:Class`."""

from __future__ import annotations

import numpy as np
import pytest

from paged import DynamicGenerator, Job
from paged.device.config import EngineConfig
from paged.errors import InvalidConfigError, InvalidConfigTypeError, PolicyError, StepError
from paged.policies import POLICIES, LongestPrefixMatch, Policy, make_policy, register_policy
from paged.sim import SimulatedEngine, StepTimeModel
from paged.testing import ByteTokenizer, ContextFakeEngine, FakeEngine, drain, page_refs

TOK = ByteTokenizer()


def make(policy, engine_cls=FakeEngine, **kw):
    return DynamicGenerator(tokenizer=TOK, engine=engine_cls(**kw), policy=policy)


def job(text, n, **kw):
    return Job(TOK.encode(text), n, identifier=kw.pop("identifier", text), **kw)


def run_collect(gen):
    """Drain; return (identifiers in order of first admission, final results by identifier)."""
    started, finals = [], {}
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "started":
                started.append(r["identifier"])
            if r["eos"]:
                finals[r["identifier"]] = r
        gen.pool.check()
    return started, finals


def reference(texts_and_lengths, engine_cls=ContextFakeEngine):
    """Outputs of each job run alone with ample pages."""
    out = {}
    for text, n in texts_and_lengths:
        gen = make("exllamav2", engine_cls, num_pages=64, max_batch_size=1)
        gen.enqueue(job(text, n))
        out[text] = drain(gen).finals[text]["full_completion"]
    return out


def test_registry_lists_the_issue_policies():
    assert {"fcfs", "exllamav2", "sjf", "priority", "vllm", "lpm", "sarathi"} <= set(POLICIES)
    for name, cls in POLICIES.items():
        p = make_policy(name)
        assert p.name == name and isinstance(p, cls) and p.allocation in ("reserve", "on_demand")
        assert cls.__module__.startswith("paged.policies.") and (cls.__doc__ or __import__(cls.__module__).__doc__)
    assert make_policy("vllm").allocation == "on_demand" and make_policy("exllamav2").allocation == "reserve"


@pytest.mark.parametrize("max_skips, expected", [(1, ["s0", "big", "s1", "s2"]), (4, ["s0", "s1", "s2", "big"])])
def test_exllamav2_skip_ahead_is_bounded_by_max_skips(max_skips, expected):
    gen = make("exllamav2", num_pages=9, page_size=8, max_batch_size=8)  # 8 usable pages
    gen.enqueue(job("r", 30, identifier="runner"))  # 31 tokens: 4 pages, reserved
    gen.iterate()
    gen.enqueue([job("B" * 40, 5, identifier="big", max_skips=max_skips)]  # 6 pages: waits for the runner
                + [job(c, 2, identifier=f"s{i}") for i, c in enumerate("xyz")])
    started, _ = run_collect(gen)
    assert started == expected


def test_fcfs_blocks_behind_the_head():
    gen = make("fcfs", num_pages=9, page_size=8, max_batch_size=8)
    gen.enqueue(job("r", 30, identifier="runner"))
    gen.iterate()
    gen.enqueue([job("B" * 40, 5, identifier="big"), job("x", 2, identifier="s0")])
    started, _ = run_collect(gen)
    assert started == ["big", "s0"]


def test_sjf_orders_by_expected_output_else_prompt_length():
    gen = make("sjf", max_batch_size=1)
    gen.enqueue(job("r", 6, identifier="runner"))
    gen.iterate()
    gen.enqueue([job("aaaaaaaaaa", 3, identifier="long-out", expected_new_tokens=9),
                 job("bbbbbbbbbb", 3, identifier="short-out", expected_new_tokens=2),
                 job("ccccc", 3, identifier="prompt5"),
                 job("ddd", 3, identifier="prompt3")])
    started, _ = run_collect(gen)
    assert started == ["short-out", "prompt3", "prompt5", "long-out"]
    gen = make("shortest_prompt_first", max_batch_size=1)  # ignores the hint
    gen.enqueue(job("r", 6, identifier="runner"))
    gen.iterate()
    gen.enqueue([job("aaaaaaaaaa", 3, identifier="a10", expected_new_tokens=1), job("ccccc", 3, identifier="c5")])
    assert run_collect(gen)[0] == ["c5", "a10"]


def test_vllm_allocates_on_demand_and_preempts_the_latest_arrival():
    texts = [("a" * 7, 12), ("b" * 7, 12), ("c" * 7, 12)]  # 19 tokens = 3 pages each; the pool has 6
    gen = make("vllm", ContextFakeEngine, num_pages=7, page_size=8, max_batch_size=4)
    gen.enqueue([job(t, n) for t, n in texts])
    started = [r["identifier"] for r in gen.iterate() if r["stage"] == "started"]
    assert started == [t for t, _ in texts]
    assert [len(j.pages) for j in gen.active] == [1, 1, 1]  # the prompt only, not prompt + max_new_tokens
    restarted, finals = run_collect(gen)
    assert restarted == []  # a re-admission after preemption is not a new start
    assert [finals[t]["preemptions"] for t, _ in texts] == [0, 0, 1]  # c arrived last
    ref = reference(texts)
    for t, _ in texts:
        assert finals[t]["full_completion"] == ref[t] and len(ref[t]) == 12
    m = gen.metrics()
    assert m["preemptions"] == 1 and m["tokens_recomputed"] > 0 and m["pages_used"] == 0


def test_reserve_allocation_never_preempts_and_on_demand_override():
    texts = [("a" * 7, 12), ("b" * 7, 12), ("c" * 7, 12)]
    gen = make("fcfs", ContextFakeEngine, num_pages=7, page_size=8, max_batch_size=4)
    gen.enqueue([job(t, n) for t, n in texts])
    started, finals = run_collect(gen)
    assert gen.metrics()["preemptions"] == 0 and all(f["preemptions"] == 0 for f in finals.values())
    gen = DynamicGenerator(tokenizer=TOK, engine=ContextFakeEngine(num_pages=7, page_size=8),
                           policy=make_policy("fcfs", allocation="on_demand"))
    gen.enqueue([job(t, n) for t, n in texts])
    _, finals = run_collect(gen)
    assert gen.metrics()["preemptions"] == 1 and finals["c" * 7]["preemptions"] == 1


def test_priority_arrival_preempts_the_lowest_priority_latest_job():
    gen = make("priority", ContextFakeEngine, num_pages=32, page_size=8, max_batch_size=2)
    gen.enqueue([job("low-old", 20, priority=0), job("low-new", 20, priority=0)])
    for _ in range(4):
        gen.iterate()
    gen.enqueue(job("urgent", 4, priority=5))
    r = gen.iterate()
    assert [x["identifier"] for x in r if x["stage"] == "started"] == ["urgent"]
    assert [j.identifier for j in gen.pending] == ["low-new"]  # back at the front of the queue
    gen.enqueue(job("mid", 4, priority=0))  # equal priority: cannot preempt
    _, finals = run_collect(gen)
    assert {k: f["preemptions"] for k, f in finals.items()} == {"low-old": 0, "low-new": 1, "urgent": 0, "mid": 0}
    ref = reference([("low-old", 20), ("low-new", 20), ("urgent", 4), ("mid", 4)])
    assert {k: f["full_completion"] for k, f in finals.items()} == ref


def test_priority_orders_waiting_jobs_and_victim_on_page_shortage():
    gen = make("priority", max_batch_size=1)
    gen.enqueue(job("r", 5, identifier="runner", priority=9))
    gen.iterate()
    gen.enqueue([job("x", 2, identifier="p0"), job("y", 2, identifier="p3", priority=3),
                 job("z", 2, identifier="pm1", priority=-1)])
    assert run_collect(gen)[0] == ["p3", "p0", "pm1"]
    p = make_policy("priority")
    a, b, c = Job([1], 1, priority=1), Job([1], 1, priority=0), Job([1], 1, priority=0)
    for i, j in enumerate((a, b, c)):
        j.serial, j.time_enqueue = i + 1, float(i)
    assert p.victim([a, b, c], a, None) is c


def test_lpm_prefers_the_longest_cached_prefix():
    shared = "S" * 24  # three full pages of 8
    gen = make(LongestPrefixMatch(aging=0), num_pages=40, page_size=8, max_batch_size=1)
    gen.enqueue(job(shared + "warm", 2, identifier="warm"))
    run_collect(gen)  # its pages stay in the prompt cache
    gen.enqueue(job("r", 4, identifier="runner"))
    gen.iterate()
    gen.enqueue([job("Z" * 28, 2, identifier="cold"), job(shared[:16] + "half", 2, identifier="half"),
                 job(shared + "full", 2, identifier="full")])
    started, finals = run_collect(gen)
    assert started == ["full", "half", "cold"]
    assert finals["full"]["cached_tokens"] == 24 and finals["half"]["cached_tokens"] == 16


@pytest.mark.parametrize("aging", [0.0, 16.0])
def test_lpm_aging_bounds_starvation(aging):
    """A job matching nothing, behind a growing backlog of cache-hitting jobs (one arrives per step, each runs ~3
    steps): without aging it is never admitted; with aging no job that arrived more than max_seq_len / aging
    seconds after it is admitted before it."""
    cfg = EngineConfig(num_pages=40, page_size=8, max_batch_size=1, max_chunk_size=16, max_seq_len=64)
    sim = SimulatedEngine(cfg, StepTimeModel.constant(1.0))
    policy = LongestPrefixMatch(aging=aging)
    gen = DynamicGenerator(tokenizer=TOK, engine=sim, policy=policy)
    hit = "H" * 16
    gen.enqueue(job(hit + "0", 2, identifier="h0"))
    drain(gen)  # caches the shared prefix
    gen.enqueue([job(hit + "a", 2, identifier="ha"), job("cold prompt....x", 2, identifier="cold")])
    cold = gen.pending[-1]
    admitted_before = []
    cold_started = None
    for i in range(120):
        gen.enqueue(job(hit + f"{i:03d}", 2, identifier=f"h{i}"))
        for r in gen.iterate():
            if r["stage"] == "started":
                if r["identifier"] == "cold":
                    cold_started = sim.clock()
                elif cold_started is None:
                    admitted_before.append(r["job"].arrival)
        if cold_started is not None:
            break
    bound = policy.starvation_bound(cfg.max_seq_len)
    if aging == 0:
        assert cold_started is None and bound == float("inf")  # starved for the whole run
    else:
        assert cold_started is not None and bound == 4.0
        assert admitted_before and max(admitted_before) <= cold.arrival + bound
        assert cold_started - cold.arrival <= 3 * len(admitted_before) + 3  # each job ahead held the row ~3 steps


def test_sarathi_prefill_fills_the_token_budget_left_by_decodes():
    def chunk_sizes(policy):
        gen = make(policy, num_pages=64, page_size=8, max_batch_size=4, max_chunk_size=16)
        gen.enqueue([job(c, 30) for c in "abc"])
        for _ in range(4):
            gen.iterate()  # a, b, c prefilled (one prefill row per step) and decoding
        gen.enqueue(job("L" * 60, 2, identifier="long"))
        start = len(gen.engine.calls)
        run_collect(gen)
        return [len(r.tokens) for rows in gen.engine.calls[start:] for r in rows if len(r.tokens) > 1
                and sum(len(x.tokens) == 1 and x.sample for x in rows) == 3]

    assert chunk_sizes("sarathi")[:3] == [13, 13, 13]  # 16 - 3 decode rows
    assert chunk_sizes("exllamav2")[:3] == [16, 16, 16]  # decodes ride beside a whole chunk


def test_user_policy_by_module_and_class_name():
    p = make_policy("experiments.policies.edf:EarliestDeadlineFirst")
    assert p.name == "edf" and p.allocation == "on_demand"
    gen = make("experiments.policies.edf:EarliestDeadlineFirst", max_batch_size=1)
    gen.enqueue(job("r", 5, identifier="runner"))
    gen.iterate()
    gen.enqueue([job("x", 2, identifier="none"), job("y", 2, identifier="late", deadline=50.0),
                 job("z", 2, identifier="soon", deadline=1.0)])
    assert run_collect(gen)[0] == ["soon", "late", "none"]


def test_register_policy_and_errors():
    @register_policy
    class NewestFirst(Policy):
        name = "test_newest_first"

        def order(self, waiting, s):
            return sorted(waiting, key=lambda j: -j.serial)

    try:
        gen = make("test_newest_first", max_batch_size=1)
        gen.enqueue(job("r", 4, identifier="runner"))
        gen.iterate()
        gen.enqueue([job("x", 2, identifier="first"), job("y", 2, identifier="second")])
        assert run_collect(gen)[0] == ["second", "first"]
        with pytest.raises(InvalidConfigError, match="taken by NewestFirst"):
            register_policy(type("Other", (Policy,), {"name": "test_newest_first"}))
    finally:
        del POLICIES["test_newest_first"]
    with pytest.raises(InvalidConfigError, match="unknown policy 'lifo'.*module:Class"):
        make_policy("lifo")
    with pytest.raises(InvalidConfigError, match="cannot import module 'no_such_module'"):
        make_policy("no_such_module:Policy")
    with pytest.raises(InvalidConfigError, match="has no attribute 'Nope'"):
        make_policy("experiments.policies.edf:Nope")
    with pytest.raises(InvalidConfigTypeError, match="not a subclass"):
        make_policy("math:pi")
    with pytest.raises(InvalidConfigError, match="allocation must be one of"):
        make_policy("fcfs", allocation="lazy")
    with pytest.raises(InvalidConfigError, match="aging"):
        LongestPrefixMatch(aging=-1)


def test_a_bad_budget_from_a_policy_is_a_named_error():
    class NumpyBudget(Policy):  # a NumPy integer is an int (it had been refused)
        name = "numpy_budget"

        def prefill_budget(self, decode_rows, s):
            return np.int64(8)

    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), policy=NumpyBudget())
    assert gen.generate("abc", 2)

    class Bad(Policy):
        name = "bad"

        def prefill_budget(self, decode_rows, s):
            return -1

    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), policy=Bad())
    gen.enqueue(job("abc", 2))
    with pytest.raises(PolicyError, match="policy 'bad' \\(Bad\\), prefill_budget\\(\\): must return an int >= 0"):
        gen.iterate()

    class Zero(Policy):  # 0 is a fine budget while jobs decode; with none decoding nothing could ever advance
        name = "zero"

        def prefill_budget(self, decode_rows, s):
            return 0

    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), policy=Zero())
    with pytest.raises(PolicyError, match=r"prefill_budget\(\): returned 0 with no job decoding"):
        gen.generate("abc", 2)  # (had looped forever)
    gen.pool.check({})


class RaisingPolicy(Policy):
    """A user policy whose constructor fails (`make_policy` must name it)."""

    name = "raising"

    def __init__(self):
        raise RuntimeError("no config file")


class StartsTwice(Policy):
    """Hands back every waiting job twice (`order` returns `waiting + waiting`)."""

    name = "starts_twice"

    def order(self, waiting, s):
        return waiting + waiting


class IgnoresFit(Policy):
    """Starts every waiting job without asking `fits`."""

    name = "ignores_fit"

    def admit(self, waiting, s):
        for job in waiting:
            s.start(job)


def test_a_policy_handing_back_a_job_twice_cannot_leak_pages():
    """The issue's case: `order()` returning `waiting + waiting` had pages allocated over the first admission's and
    `pending.remove` raising, and every drain left more pages referenced (8, 11, 14, ...)."""
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32, max_batch_size=8), policy=StartsTwice())
    want = reference([("abc", 3), ("hello world", 4), ("xy", 2)], FakeEngine)
    for _ in range(3):
        gen.enqueue([job("abc", 3), job("hello world", 4), job("xy", 2)])
        with pytest.raises(PolicyError, match=r"policy 'starts_twice' \(StartsTwice\), admit\(\): start\(Job.*"
                                              r"the job is running \(started already") as info:
            gen.iterate()
        assert isinstance(info.value, StepError) and isinstance(info.value, InvalidConfigError)
        gen.pool.check(expected_refs=page_refs(gen))
        started, finals = run_collect(gen)  # the jobs it started once run on
        assert {k: r["full_completion"] for k, r in finals.items()} == want
        assert gen.pool.num_referenced == 0 and not gen.pending and not gen.active


def test_a_policy_starting_a_job_that_does_not_fit_gets_a_named_error():
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=6, max_batch_size=4), policy=IgnoresFit())
    gen.enqueue([job("a" * 15, 8, identifier="big"), job("b" * 15, 8, identifier="big2"), job("c", 2)])
    with pytest.raises(PolicyError, match=r"admit\(\): start\(Job.*does not fit now.*fits\(job\)"):
        gen.iterate()  # (had been the page pool's internal "check pages_needed() before allocate()")
    gen.pool.check(expected_refs=page_refs(gen))
    assert [j.identifier for j in gen.active] == ["big"] and len(gen.pending) == 2
    stranger = Job(TOK.encode("zz"), 2)

    class StartsAStranger(Policy):
        name = "stranger"

        def admit(self, waiting, s):
            s.start(stranger)

    class PreemptsAWaitingJob(Policy):
        name = "preempts_waiting"
        preemptive = True

        def admit(self, waiting, s):
            s.preempt(waiting[0])

    class StartsAString(Policy):
        name = "starts_a_string"

        def admit(self, waiting, s):
            s.start("job 1")

    for policy, match in ((StartsAStranger(), r"admit\(\): start\(Job.*not waiting in this generator"),
                          (PreemptsAWaitingJob(), r"admit\(\): preempt\(Job.*not running"),
                          (StartsAString(), r"admit\(\): start\(\) takes one of the waiting jobs, got str")):
        gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=16), policy=policy)
        gen.enqueue(job("abc", 2))
        with pytest.raises(PolicyError, match=match):
            gen.iterate()
        assert gen.pool.num_referenced == 0 and len(gen.pending) == 1 and not gen.active


def test_a_bad_victim_or_a_raising_hook_is_a_named_policy_error():
    class WaitingVictim(Policy):
        name = "waiting_victim"
        allocation = "on_demand"

        def victim(self, running, needy, s):
            return s.waiting_job

    class Raises(Policy):
        name = "raises"

        def order(self, waiting, s):
            return sorted(waiting, key=lambda j: 1 / 0)

    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=6, page_size=4, max_batch_size=2),
                           policy=WaitingVictim())
    gen.scheduler.view.waiting_job = Job(TOK.encode("q"), 2)
    gen.enqueue([job("ab", 12, identifier="one"), job("cd", 12, identifier="two")])
    with pytest.raises(PolicyError, match=r"victim\(\): returned Job.*not a running job.*None for the needy job"):
        for _ in range(40):
            gen.iterate()
    gen.pool.check(expected_refs=page_refs(gen))
    assert len(gen.active) == 2
    gen = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), policy=Raises())
    gen.enqueue([job("abc", 2), job("de", 2)])
    with pytest.raises(PolicyError, match=r"'raises' \(Raises\), admit\(\): raised ZeroDivisionError") as info:
        gen.iterate()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert gen.pool.num_referenced == 0 and len(gen.pending) == 2


def test_start_and_preempt_outside_admit_are_policy_errors_and_running_is_read_only():
    """preempt() from victim() had left the preempted job's row in the step with its pages released (two innocent
    jobs failed with an IndexError); a policy popping `s.running` had lost a job and leaked its pages."""
    class PreemptsInVictim(Policy):
        name = "preempts_in_victim"
        allocation = "on_demand"

        def victim(self, running, needy, s):
            s.preempt(next(r for r in running if r is not needy))
            return needy

    class StartsInBudget(Policy):
        name = "starts_in_budget"

        def prefill_budget(self, decode_rows, s):
            if self.waiting:
                s.start(self.waiting[0])
            return s.config.max_chunk_size

        def admit(self, waiting, s):
            self.waiting = list(waiting)[1:]
            for j in list(waiting)[:1]:
                s.start(j)

    class PopsRunning(Policy):
        name = "pops_running"

        def admit(self, waiting, s):
            super().admit(waiting, s)
            if len(s.running) > 1:
                s.running.pop()

    specs = [("abcd", 12), ("efgh", 12), ("ijkl", 12)]
    for policy, match in ((PreemptsInVictim(), r"victim\(\): preempt\(\) may be called only from admit\(\)"),
                          (StartsInBudget(), r"prefill_budget\(\): start\(\) may be called only from admit\(\)")):
        gen = make(policy, ContextFakeEngine, num_pages=8, page_size=4, max_batch_size=3)
        gen.enqueue([job(t, n) for t, n in specs])
        with pytest.raises(PolicyError, match=match):
            for _ in range(60):
                gen.iterate()
        gen.pool.check(expected_refs=page_refs(gen))
    gen = make(PopsRunning(), ContextFakeEngine, num_pages=16, page_size=4, max_batch_size=3)
    gen.enqueue([job(t, n) for t, n in specs])
    with pytest.raises(PolicyError, match=r"admit\(\): raised AttributeError: 'ReadOnlyJobs' object has no "
                                          r"attribute 'pop'"):
        for _ in range(10):
            gen.iterate()
    gen.pool.check(expected_refs=page_refs(gen))


def test_a_policy_whose_constructor_raises_is_named():
    for spec in ("tests.paged.test_policies:RaisingPolicy", RaisingPolicy):
        with pytest.raises(InvalidConfigError, match=r"policy '.*RaisingPolicy'.*raised RuntimeError: no config "
                                                     "file") as info:
            make_policy(spec)
        assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(InvalidConfigError, match="RaisingPolicy"):
        DynamicGenerator(tokenizer=TOK, engine=FakeEngine(), policy="tests.paged.test_policies:RaisingPolicy")
