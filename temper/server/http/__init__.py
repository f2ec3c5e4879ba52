"""The HTTP edge: the app factory, body limits and JSON parsing, the request log, keys and
users, error bodies, responses, and the machinery of the plain (non-FastAPI) routes."""
