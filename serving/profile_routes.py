"""POST /start_profile and /stop_profile: a torch profiler trace of the engine's scheduler loop (as vLLM's and
SGLang's servers offer). Profiling is opt-in: the server must start with `--profile-dir DIR`, where the traces
are written (engine/profiling.py); otherwise, or in the cluster, both answer 400 `profiling_unavailable`.

    POST /start_profile  {"num_steps": N}   (optional: stop by itself after N steps with work)
                         -> {"trace": path the trace will be written to}
    POST /stop_profile   -> {"trace": path written}
"""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from engine.profiling import ProfileError
from serving.errors import APIError
from serving.state import get_state

router = APIRouter()


class StartProfileRequest(BaseModel):
    num_steps: Optional[int] = Field(default=None, ge=1, description="Stop by itself after this many steps.")


class ProfileResponse(BaseModel):
    trace: str


@router.post("/start_profile", response_model=ProfileResponse)
async def start_profile(request: Request, body: Optional[StartProfileRequest] = None) -> ProfileResponse:
    backend = get_state(request).backend
    try:
        return ProfileResponse(trace=await backend.start_profile(body.num_steps if body is not None else None))
    except ProfileError as exc:
        raise APIError(400, str(exc), None, "profiling_unavailable") from None


@router.post("/stop_profile", response_model=ProfileResponse)
async def stop_profile(request: Request) -> ProfileResponse:
    backend = get_state(request).backend
    try:
        return ProfileResponse(trace=await backend.stop_profile())
    except ProfileError as exc:
        raise APIError(400, str(exc), None, "profiling_unavailable") from None
