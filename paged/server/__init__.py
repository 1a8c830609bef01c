"""An OpenAI-compatible HTTP server on the dynamic generator (docs/server.md).

    from paged.server import create_app, serve
    serve(create_app(DynamicGenerator(model), model_name="smollm2-135m"), port=8000)

`python -m experiments.serve` is the command line. Needs the `server` extra (`pip install -e ".[server]"`: FastAPI,
uvicorn, pydantic, prometheus_client); nothing else in `paged` imports this package.

Modules: `protocol` (request bodies), `translate` (request -> jobs), `service` (the generator's asyncio loop for
serving), `responses` (results -> OpenAI objects), `metrics` (Prometheus), `errors` (OpenAI error bodies), `app`
(routes), `run` (uvicorn with a graceful stop).
"""

from paged.server.app import create_app
from paged.server.run import make_server, serve

__all__ = ["create_app", "make_server", "serve"]
