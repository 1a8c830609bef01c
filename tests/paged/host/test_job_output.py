"""`paged.host.job_output.JobOutput`: what a job's sampled tokens do once its row ran. Fed directly here (the
generator's own `output`, a job admitted over the fake engine): the stop token ends the job without its text, a stop
string ends it holding back the string, max_new_tokens ends it, the text of a multi-byte character waits for its
last byte, several tokens of one row stop at the first that ends the job, and the KV position follows the fed
tokens. No model, no compilation."""

from __future__ import annotations

from paged import DynamicGenerator, Job
from paged.testing import ByteTokenizer, FakeEngine

TOK = ByteTokenizer()


def started(job: Job) -> DynamicGenerator:
    g = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(num_pages=32, page_size=8, max_batch_size=4,
                                                          max_chunk_size=16, max_seq_len=128))
    g.enqueue(job)
    g.scheduler.admit(lambda job: None)
    return g


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def test_a_stop_token_ends_the_job_without_its_text():
    job = Job(ids("ab"), 8, stop_conditions=[ids("!")[0]])
    g = started(job)
    r = g.output.feed(job, ids("x"), 2, [{}], 1.0)[0]
    assert not r["eos"] and r["text"] == "x" and job.kv_position == 2
    r = g.output.feed(job, ids("!"), 1, [{}], 2.0)[0]
    assert r["eos"] and r["eos_reason"] == "stop_token" and r["full_completion"] == "x"
    assert r["held"]["token_ids"] == ids("!") and r["new_tokens"] == 2


def test_a_stop_string_ends_the_job_and_holds_back_the_string():
    job = Job(ids("ab"), 16, stop_conditions=["END"])
    g = started(job)
    texts = [g.output.feed(job, [t], 1 + (i == 0), [{}], 1.0)[0] for i, t in enumerate(ids("okEN"))]
    assert "".join(r["text"] for r in texts) == "ok"  # "EN" may begin the stop string: held back
    r = g.output.feed(job, ids("D"), 1, [{}], 2.0)[0]
    assert r["eos"] and r["eos_reason"] == "stop_string" and r["eos_triggering_string"] == "END"
    assert r["full_completion"] == "ok"


def test_max_new_tokens_ends_the_job_and_releases_every_held_token():
    job = Job(ids("ab"), 3, stop_conditions=["xyz"])
    g = started(job)
    out = g.output.feed(job, ids("qx"), 2, [{}, {}], 1.0)  # (a row's token, then an accepted draft)
    assert [r["text"] for r in out] == ["q", ""] and not out[-1]["eos"]  # "x" may begin "xyz"
    r = g.output.feed(job, ids("y"), 1, [{}], 2.0)[0]
    assert r["eos"] and r["eos_reason"] == "max_new_tokens" and r["text"] == "xy" and r["full_completion"] == "qxy"


def test_a_multibyte_character_waits_for_its_last_byte():
    job = Job(ids("ab"), 8)
    g = started(job)
    snow = list("☃".encode())  # 3 bytes: ByteTokenizer ids are the bytes
    out = g.output.feed(job, snow, 2 + 2, [{}, {}, {}], 1.0)
    assert [r["text"] for r in out] == ["", "", "☃"]
    assert job.kv_position == 4 and job.new_tokens == 3  # the row's input and two accepted drafts have K/V


def test_feeding_stops_at_the_first_token_that_ends_the_job():
    job = Job(ids("ab"), 8, stop_conditions=[ids("!")[0]])
    g = started(job)
    out = g.output.feed(job, ids("k!zz"), 2 + 3, [{}] * 4, 1.0)
    assert len(out) == 2 and out[-1]["eos_reason"] == "stop_token"
    assert job.sequence == ids("abk!") and job.kv_position == 3  # the tokens after the stop are not received


def test_extras_are_released_with_their_tokens():
    job = Job(ids("ab"), 8, stop_conditions=["zz"])
    g = started(job)
    r1 = g.output.feed(job, ids("z"), 2, [{"token_probs": 0.25}], 1.0)[0]
    assert r1["text"] == "" and "token_probs" not in r1  # held with its token
    r2 = g.output.feed(job, ids("q"), 1, [{"token_probs": 0.5}], 2.0)[0]
    assert r2["text"] == "zq" and r2["token_probs"] == [0.25, 0.5]
