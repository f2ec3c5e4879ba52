"""The ids the server hands out, and the check every id and name passes before it reaches the
disk (`checked`: no `/`, no `..`, so no request can address a path outside the storage root).

Session, sampling session and request ids are random; a training model's id follows Tinker's
scheme, `<session>:train:<model_seq_id>`, which the SDK derives itself for create-via-load,
and doubles as the run id on disk.
"""

from __future__ import annotations

import uuid

from temper.checkpoint.storage import check_name
from temper.server.http.errors import BadRequest


def new_session_id() -> str:
    return f"sess-{uuid.uuid4().hex[:16]}"


def new_sampling_session_id() -> str:
    # No ':' or '/' (it appears in URL paths and other servers route on ':').
    return f"samp-{uuid.uuid4().hex[:16]}"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def model_id(session_id: str, model_seq_id: int) -> str:
    """Tinker's scheme; the SDK derives exactly this id itself for create-via-load."""
    return checked(f"{session_id}:train:{model_seq_id}", field="model id")


def checked(name: str, *, field: str) -> str:
    try:
        return check_name(name, field=field)
    except ValueError as error:
        raise BadRequest(str(error)) from None
