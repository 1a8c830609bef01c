"""Per-request LoRA over HTTP: an adapter loaded into the server's generator is listed by `/v1/models` and used by a
request that names it as the model or as the `lora` extra field (the same text either way, another than the base
model's). The adapter is a random PEFT directory written as the LoRA tests write one, and the generator takes their
sizes, so the steps are the programs those tests compiled (the suite's compilation cache shares them)."""

from __future__ import annotations

import httpx
import pytest

from paged import DynamicGenerator
from tests.paged.test_lora import GEN, MODEL, write_adapter
from tests.server.helpers import DEADLINE_S, LiveServer

ADAPTER = "tuned"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gen = DynamicGenerator(MODEL, **GEN)
    gen.load_lora(ADAPTER, write_adapter(tmp_path_factory.mktemp("lora") / ADAPTER, seed=1))
    s = LiveServer(gen, model_name="tiny")
    yield s
    s.stop()


def test_an_adapter_is_served_by_its_name(server):
    models = httpx.get(f"{server.base}/v1/models", timeout=DEADLINE_S).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), (ADAPTER, "tiny")]
    client = server.openai(timeout=DEADLINE_S)

    def text(model: str, **extra) -> str:
        r = client.completions.create(model=model, prompt="Adapted", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})
        return r.choices[0].text

    by_model, by_field, base = text(ADAPTER), text("tiny", lora=ADAPTER), text("tiny")
    assert by_model == by_field
    assert by_model != base


def test_an_adapter_loaded_after_the_app_is_served_and_a_name_clash_is_refused(server, tmp_path):
    """The app reads the generator's adapters when a request comes (it had kept the set of create_app's time: a
    later adapter was listed but every request for it got a 400); an adapter under the served model's name is
    refused when the app is made, and never listed twice."""
    from paged.server import create_app

    gen = server.app.state.paged.generator
    gen.load_lora("late", write_adapter(tmp_path / "late", seed=2))
    try:
        models = [m["id"] for m in httpx.get(f"{server.base}/v1/models", timeout=DEADLINE_S).json()["data"]]
        assert models == ["tiny", "late", ADAPTER]
        body = {"model": "late", "prompt": "Adapted", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
    finally:
        gen.unload_lora("late")
    with pytest.raises(ValueError, match="served model's name 'tuned'"):
        create_app(gen, model_name=ADAPTER)
