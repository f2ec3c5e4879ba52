"""A Tinker-compatible HTTP server: the unmodified `tinker` SDK trains and samples through it.

    temper serve --model DIR [--host 127.0.0.1] [--port 8000] [--storage DIR] [--api-key tml-...]

`TemperServer` holds the state and the backend (by default the in-process `ServiceClient`);
`create_app` builds the FastAPI app on it. FastAPI, uvicorn and tinker come with the
`server` extra and are imported only here.
"""

from temper.server.http.app import create_app
from temper.server.state.server import TemperServer

__all__ = ["TemperServer", "create_app"]
