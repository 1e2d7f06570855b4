"""GET /v1/models and /v1/models/{id}: the one model this server serves (its aliases answer too)."""

from __future__ import annotations

from fastapi import Request

from dsv41.server.state import ServerState
from dsv41.server.validation import check_model


def model_card(state: ServerState) -> dict:
    s = state.settings
    return {"id": s.model_name, "object": "model", "created": state.created, "owned_by": "dsv41",
            "root": s.checkpoint, "max_model_len": state.engine.max_seq_len, "chat_template": state.template.name}


async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(request.app.state.dsv41)]}


async def retrieve_model(request: Request, model_id: str) -> dict:
    state = request.app.state.dsv41
    check_model(state.settings, model_id)
    return model_card(state)
