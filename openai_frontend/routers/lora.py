"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"}. Mounted only with allow_runtime_lora_updating, which the
frontend refuses without an API key: loading names a folder on the server.

The frontend keeps the names; each request to a runtime adapter carries its path to Triton, whose
model registers it on first use and loads it into a slot (every replica alike). A folder that is not
a peft adapter is a 400 here; its rank and shapes are checked by the engine on the first request.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from openai_frontend.errors import OpenAIError, invalid
from openai_frontend.schemas import ErrorResponse

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it; the name decides here


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses={400: {"model": ErrorResponse}})
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw_request: Request):
    frontend = raw_request.app.state.frontend
    name, path = body.lora_name.strip(), Path(body.lora_path).expanduser()
    if not name:
        raise invalid("lora_name", "lora_name: must not be empty")
    if name in frontend.loras or name in (frontend.settings.served_model_name, frontend.settings.embeddings_model_name):
        raise invalid("lora_name", f"The lora adapter '{name}' has already been loaded.")
    if not (path / "adapter_config.json").is_file() or not (path / "adapter_model.safetensors").is_file():
        raise invalid("lora_path", "lora_path: not a peft LoRA adapter folder (adapter_config.json and "
                                   "adapter_model.safetensors)")
    frontend.loras[name] = (str(path.resolve()), True)
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses={404: {"model": ErrorResponse}})
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw_request: Request):
    frontend = raw_request.app.state.frontend
    if body.lora_name not in frontend.loras:
        raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name", "model_not_found")
    del frontend.loras[body.lora_name]
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
