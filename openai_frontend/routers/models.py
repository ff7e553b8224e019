"""GET /v1/models: the LLM (under --served-model-name), its LoRA adapters (the base model as their
`parent`) and the embeddings model, when at least one Triton replica has them loaded."""

from __future__ import annotations

from fastapi import APIRouter, Request

from openai_frontend.errors import model_not_found
from openai_frontend.schemas import ErrorResponse, ModelCard, ModelList
from openai_frontend.triton import EMBEDDINGS_MODEL, LLM_MODEL

router = APIRouter()


async def model_cards(frontend) -> list[ModelCard]:
    cards = []
    if await frontend.triton.model_ready(LLM_MODEL):
        base = frontend.settings.served_model_name
        cards.append(ModelCard(id=base, created=frontend.started, max_model_len=frontend.prompts.max_model_len))
        cards += [ModelCard(id=name, created=frontend.started, root=path, parent=base,
                            max_model_len=frontend.prompts.max_model_len)
                  for name, (path, _) in frontend.loras.items()]
    if await frontend.triton.model_ready(EMBEDDINGS_MODEL):
        cards.append(ModelCard(id=frontend.settings.embeddings_model_name, created=frontend.started))
    return cards


@router.get("/v1/models", response_model=ModelList)
async def list_models(raw_request: Request):
    return ModelList(data=await model_cards(raw_request.app.state.frontend))


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
async def retrieve_model(model: str, raw_request: Request):
    for card in await model_cards(raw_request.app.state.frontend):
        if card.id == model:
            return card
    raise model_not_found(model)
