"""The typed sub-configs: EngineConfig parses `speculative_config` and `lora_modules` once, whatever
form they come in (LLM(...) keywords, model.json, `tritonllm serve` flags, vLLM's dicts), refuses a bad
value there with a message naming the knob, and hands the parsed value on intact (dataclasses.replace,
the JSON the tensor-parallel ranks read, the model.json serve writes, the OpenAI frontend's flags)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from backend.config import EngineConfig, SpeculativeConfig
from backend.lora import RUNTIME_LORA_ENV
from openai_frontend.app import Settings
from openai_frontend.main import parse_settings
from tools.cli import add_engine_arguments, engine_config_from_args

NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=2)
NGRAM_DICT = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def engine_flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("given", [NGRAM_DICT, json.dumps(NGRAM_DICT), NGRAM], ids=["dict", "json", "parsed"])
def test_speculative_config_is_parsed_once_whatever_form_it_comes_in(given):
    parsed = EngineConfig(speculative_config=given).speculative_config  # as the LLM keyword argument
    assert parsed == NGRAM and SpeculativeConfig.parse(parsed) is parsed
    assert EngineConfig.from_dict({"speculative_config": given}).speculative_config == NGRAM  # model.json


def test_speculative_config_from_the_flags_and_none():
    cli = engine_config_from_args(engine_flags(["--speculative-config", json.dumps(NGRAM_DICT)]))
    assert cli.speculative_config == NGRAM
    assert EngineConfig().speculative_config is None
    assert EngineConfig.from_dict({"speculative_config": "none"}).speculative_config is None


def test_a_bad_speculative_config_fails_at_construction_naming_the_knob():
    with pytest.raises(ValueError, match="^speculative_config: num_speculative_tokens must be a positive integer"):
        EngineConfig.from_dict({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 0}'})
    with pytest.raises(ValueError, match="^speculative_config: not valid JSON"):
        engine_config_from_args(engine_flags(["--speculative-config", "{method: ngram}"]))


def test_replace_keeps_the_parsed_config_and_can_drop_it():
    config = EngineConfig(speculative_config=NGRAM_DICT, enable_lora=True, lora_modules=["a=/adapters/a"])
    assert dataclasses.replace(config, seed=1).speculative_config is config.speculative_config
    draft = dataclasses.replace(config, speculative_config=None, enable_lora=False, lora_modules=None)
    assert draft.speculative_config is None and draft.lora_modules is None


@pytest.mark.parametrize("speculative_config", [
    NGRAM_DICT, {"model": "~/draft", "num_speculative_tokens": 2}], ids=["ngram", "draft_model"])
def test_the_workers_json_reads_back_into_the_same_config(speculative_config):
    world = 2 if "model" not in speculative_config else 1  # draft_model runs without parallelism
    config = EngineConfig(tensor_parallel_size=world, speculative_config=speculative_config,
                          enable_lora=world == 1, lora_modules={"a": "/adapters/a"} if world == 1 else None,
                          override_generation_config='{"temperature": 0.5}')
    spec = json.dumps({"config": config.to_dict()})  # as backend/worker/distributed.py sends it to a rank
    assert EngineConfig.from_dict(json.loads(spec)["config"]) == config


def test_serve_writes_the_parsed_knobs_into_model_json(tmp_path):
    from tools.serve import engine_arguments
    from tools.triton_server import MODEL_NAME, write_model_repository

    model = tmp_path / "model"
    model.mkdir()
    args = engine_flags(["--model", str(model), "--speculative-config", json.dumps(NGRAM_DICT),
                         "--enable-lora", "--lora-modules", "a=/adapters/a", "b=/adapters/b"])
    repository = write_model_repository(tmp_path / "repository", engine_arguments(args))
    model_json = json.loads((repository / MODEL_NAME / "1" / "model.json").read_text(encoding="utf-8"))
    config = EngineConfig.from_dict(model_json)
    assert config.speculative_config == NGRAM
    assert config.lora_modules == {"a": "/adapters/a", "b": "/adapters/b"}


def test_the_frontend_reads_lora_modules_with_the_engines_parser():
    flags = ["--lora-modules", "a=/adapters/a", "b=/adapters/b"]
    settings, _ = parse_settings(flags)
    engine = engine_config_from_args(engine_flags(["--enable-lora", *flags]))
    assert settings.lora_modules == engine.lora_modules == {"a": "/adapters/a", "b": "/adapters/b"}
    vllm_style = '[{"name": "a", "path": "/adapters/a"}, {"name": "b", "path": "/adapters/b"}]'
    assert Settings(lora_modules=vllm_style).lora_modules == settings.lora_modules
    with pytest.raises(ValueError, match="^lora_modules: names must be unique"):
        Settings(lora_modules=["a=/x", "a=/y"])
    with pytest.raises(SystemExit):
        parse_settings(["--lora-modules", "no-path"])


def test_runtime_lora_updating_is_read_from_one_variable(monkeypatch):
    monkeypatch.setenv(RUNTIME_LORA_ENV, "true")
    with pytest.raises(ValueError, match=f"{RUNTIME_LORA_ENV}.*need an API key"):
        Settings(model="/models/m").resolved()
    assert Settings(model="/models/m", api_key="k").resolved().allow_runtime_lora_updating
    monkeypatch.setenv(RUNTIME_LORA_ENV, "0")
    assert not Settings(model="/models/m").resolved().allow_runtime_lora_updating
