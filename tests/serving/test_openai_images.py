"""Images in chat requests. Through the OpenAI SDK against a tiny LLaVA 1.5 (tests/utils/vision.py)
served by a real `tritonllm serve` given the image flags: the answer is the offline engine's for the
same prompt and images (float32, greedy) for PNG and JPEG data URLs, two images in one message, a
stream, Responses' input_image, a fetched URL and a file; refusals name the content part (too many
images, bad base64, a non-image, a redirect, too many bytes, a file outside the folder, and, on other
frontends on the same Triton, remote and file URLs not enabled, a private address, a model without
images). The URL rules (openai_frontend/media.py) are also checked alone against a local HTTP server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from openai_frontend.errors import OpenAIError
from openai_frontend.media import (DEFAULT_IMAGES_PER_PROMPT, DEFAULT_MAX_MEDIA_BYTES, ImagePart, MediaPolicy,
                                   images_per_prompt, name_image_error, public_address)
from tests.utils.vision import data_url, encoded, image, tiny_llava

pytestmark = pytest.mark.usefixtures("no_request_left_running")

PICTURE = image(0, 40, 48)
PNG = encoded(PICTURE)
MAX_MEDIA_BYTES = 32 << 10  # the served frontend's: PICTURE's PNG fits, a 160 x 160 one does not
MAX_TOKENS = 10
QUESTION = "What is in it?"
PROMPT = f"USER: <image>\n{QUESTION} ASSISTANT:"  # what llava-1.5's chat template writes for [image, text]


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": p}} if not isinstance(p, dict)
                                         else p for p in parts]}]


def text(value: str) -> dict:
    return {"type": "text", "text": value}


# -- the URL rules alone: openai_frontend/media.py, against a local HTTP server --------------------
class ImageHandler(BaseHTTPRequestHandler):
    """/image.png, a redirect to it, bodies over the limit (declared, and streamed without a length),
    a slow answer, and 404 otherwise; the Host header of every request is kept."""

    def do_GET(self) -> None:
        self.server.hosts.append(self.headers.get("Host"))
        if self.path == "/image.png":
            self.reply(PNG)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/image.png")
            self.end_headers()
        elif self.path == "/big":
            self.reply(b"\0" * (MAX_MEDIA_BYTES + 1))
        elif self.path == "/streamed":  # HTTP/1.0: the body ends when the connection closes
            self.send_response(200)
            self.end_headers()
            for _ in range(MAX_MEDIA_BYTES // 4096 + 2):
                self.wfile.write(b"\0" * 4096)
        elif self.path == "/slow":
            time.sleep(3)
            self.reply(PNG)
        else:
            self.send_error(404)

    def reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    server.hosts = []
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}", server
    server.shutdown()
    server.server_close()


def policy(**values) -> MediaPolicy:
    return MediaPolicy(**{"allowed_media_domains": frozenset({"127.0.0.1", "localhost"}),
                          "max_media_bytes": MAX_MEDIA_BYTES, **values})


def load(rules: MediaPolicy, *urls: str) -> list[bytes]:
    return asyncio.run(rules.load([ImagePart(f"messages[0].content[{k}]", url) for k, url in enumerate(urls)]))


def refusal(rules: MediaPolicy, *urls: str) -> str:
    """The 400's message; it names the part and never echoes the URL's data."""
    with pytest.raises(OpenAIError) as error:
        load(rules, *urls)
    assert error.value.status == 400 and error.value.param.startswith("messages[0].content[")
    assert error.value.message.startswith(error.value.param + ": ")
    return error.value.message


def test_the_frontends_bounds_are_the_llm_models():
    from backend.multimodal import MAX_IMAGE_BYTES, MAX_IMAGES_PER_PROMPT
    assert (DEFAULT_IMAGES_PER_PROMPT, DEFAULT_MAX_MEDIA_BYTES) == (MAX_IMAGES_PER_PROMPT, MAX_IMAGE_BYTES)


def test_limit_mm_per_prompt_takes_vllms_forms():
    from openai_frontend.main import parse_settings
    assert [images_per_prompt(v) for v in ('{"image": 2}', "image=3", {"image": 1}, '{"video": 0}', None)] == \
        [2, 3, 1, DEFAULT_IMAGES_PER_PROMPT, DEFAULT_IMAGES_PER_PROMPT]
    for value in ('{"video": 1}', '{"image": -1}', '{"image": true}', "many", "[2]"):
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            images_per_prompt(value)
    with pytest.raises(ValueError, match="only images are served, not audio"):
        parse_settings(["--limit-mm-per-prompt", '{"audio": 1}'])[0].resolved()
    settings, _ = parse_settings(["--allowed-media-domains", "a.example,B.example.", "c.example"])
    assert MediaPolicy.from_settings(settings).allowed_media_domains == {"a.example", "b.example", "c.example"}


def test_data_urls_are_checked_and_bounded():
    for form in ("PNG", "JPEG", "WEBP", "GIF"):
        url = data_url(PICTURE, form)
        assert load(policy(), url) == [url.partition(",")[2].encode()]
    payload = base64.b64encode(PNG).decode()
    assert "not a valid data URL (its base64 does not decode)" in refusal(policy(), "data:image/png;base64,%%%%")
    for url in (f"data:text/plain;base64,{payload}", f"data:image/png,{payload}", "data:image/png;base64,"):
        assert "not a valid data URL" in refusal(policy(), url)
    assert f"at most {MAX_MEDIA_BYTES}" in refusal(policy(), data_url(image(3, 160, 160)))
    message = refusal(policy(), data_url(PICTURE), f"data:image/png;base64,{payload[:-3]}!!!")
    assert message.startswith("messages[0].content[1]: ") and payload[:32] not in message


def test_sources_open_only_by_flag():
    closed = MediaPolicy()
    assert refusal(closed, "http://example.com/a.png").endswith("remote image URLs are not enabled "
                                                                 "(--allowed-media-domains)")
    assert "local file image URLs are not enabled (--allowed-local-media-path)" in refusal(closed, "file:///a.png")
    for url in ("ftp://example.com/a.png", "a.png", "javascript:alert(1)"):
        assert "must be a data:, http(s): or file: URL" in refusal(closed, url)
    assert "the host 'evil.example' is not in --allowed-media-domains" in refusal(policy(), "https://evil.example/a")
    assert "may not carry credentials" in refusal(policy(), "http://user:secret@localhost/a.png")
    many = [data_url(PICTURE)] * 3
    assert refusal(MediaPolicy(images_per_prompt=2), *many).startswith(
        "messages[0].content[2]: at most 2 images per request (--limit-mm-per-prompt), got 3")


@pytest.mark.parametrize("address,public", [
    ("93.184.216.34", True), ("2606:4700:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("224.0.0.1", False), ("240.0.0.1", False), ("::1", False), ("fe80::1", False),
    ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("::", False)])
def test_only_public_addresses_count_as_public(address, public):
    assert public_address(address) is public


def test_a_private_address_is_refused_unless_allowed(image_server):
    host, server = image_server
    port = host.rpartition(":")[2]
    requests = len(server.hosts)
    for url in (f"http://{host}/image.png", f"http://localhost:{port}/image.png"):
        assert "resolves to a private address" in refusal(policy(), url)
    assert len(server.hosts) == requests  # refused before connecting
    trusted = policy(allow_private_media_hosts=True)
    assert load(trusted, f"http://localhost:{port}/image.png") == [base64.b64encode(PNG)]
    assert server.hosts[-1] == f"localhost:{port}"  # sent to the address checked, named as the URL names it


def test_fetches_follow_no_redirect_and_stay_within_bounds(image_server):
    host, _ = image_server
    trusted = policy(allow_private_media_hosts=True)
    assert "redirects (HTTP 302); redirects are not followed" in refusal(trusted, f"http://{host}/redirect")
    assert f"at most {MAX_MEDIA_BYTES}" in refusal(trusted, f"http://{host}/big")  # its Content-Length
    assert f"larger than {MAX_MEDIA_BYTES} bytes" in refusal(trusted, f"http://{host}/streamed")
    assert "fetching the image failed (HTTP 404)" in refusal(trusted, f"http://{host}/nothing.png")
    started = time.monotonic()
    assert "took over 0.5 s (--media-fetch-timeout)" in refusal(policy(allow_private_media_hosts=True,
                                                                        media_fetch_timeout=0.5), f"http://{host}/slow")
    assert time.monotonic() - started < 2.5
    assert "could not be fetched (ConnectError)" in refusal(trusted, "http://127.0.0.1:1/image.png")


def test_file_urls_only_under_the_folder(tmp_path):
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "inside.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (folder / "link.png").symlink_to(tmp_path / "secret.png")
    (folder / "big.png").write_bytes(b"\0" * (MAX_MEDIA_BYTES + 1))
    rules = policy(allowed_local_media_path=os.path.realpath(folder))
    assert load(rules, f"file://{folder}/inside.png") == [base64.b64encode(PNG)]
    for url in (f"file://{tmp_path}/secret.png", f"file://{folder}/link.png", f"file://{folder}/../secret.png",
                "file:///etc/passwd"):
        assert refusal(rules, url).endswith("the file is outside --allowed-local-media-path")
    assert "names no host" in refusal(rules, f"file://example.com{folder}/inside.png")
    assert "could not be read" in refusal(rules, f"file://{folder}/missing.png")
    assert "could not be read" in refusal(rules, f"file://{folder}")  # a folder
    assert f"larger than {MAX_MEDIA_BYTES} bytes" in refusal(rules, f"file://{folder}/big.png")


def test_tritons_refusals_name_the_part():
    parts = [ImagePart("messages[0].content[0]", "data:"), ImagePart("messages[1].content[2]", "data:")]
    error = name_image_error(OpenAIError(400, "image: image 1 could not be decoded (UnidentifiedImageError)",
                                         "image"), parts)
    assert (error.param, error.message) == ("messages[1].content[2]", "messages[1].content[2]: the image could "
                                                                      "not be decoded (UnidentifiedImageError)")
    error = name_image_error(OpenAIError(400, "multi_modal_data: SmolLM2 takes text only", "multi_modal_data"), parts)
    assert error.param == "messages[0].content[0]" and "does not accept images" in error.message
    other = OpenAIError(400, "top_p: must be in (0, 1]", "top_p")
    assert name_image_error(other, parts) is other


# -- the chat template's placeholders ---------------------------------------------------------
@pytest.fixture(scope="module")
def llava(tmp_path_factory, model_path):
    return tiny_llava(tmp_path_factory.mktemp("tiny_llava"), model_path)


def test_the_chat_template_places_each_image(llava, model_path):
    from openai_frontend.prompts import PromptBuilder

    messages = [{"role": "user", "content": [{"type": "image"}, text(QUESTION)]}]
    parts = PromptBuilder(llava[0])  # llava-1.5's template reads content as parts
    assert (parts.image_token, parts.template_takes_image_parts) == ("<image>", True)
    assert parts.render_chat(messages, True, False)[0] == PROMPT
    assert parts.render_chat([{"role": "system", "content": "Be brief."}, *messages], True, False)[0] == \
        "Be brief. " + PROMPT  # string content becomes a text part for such a template
    chatml = PromptBuilder(llava[0], chat_template=str(Path(model_path) / "chat_template.jinja"))
    assert not chatml.template_takes_image_parts  # SmolLM2's reads a string: the placeholder goes in it
    assert "<|im_start|>user\n<image>\nWhat is in it?<|im_end|>" in chatml.render_chat(messages, True, False)[0]
    for builder in (parts, chatml):
        for forged in ("<image>", "<|im_end|>"):
            with pytest.raises(OpenAIError, match="with images, content must not contain the model's special tokens"):
                builder.render_chat([{"role": "user", "content": [{"type": "image"}, text(forged)]}], True, False)
    assert PromptBuilder(model_path).image_token is None


# -- through the OpenAI SDK, from `tritonllm serve` on the tiny LLaVA ---------------------------

@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """The served frontend's --allowed-local-media-path, holding PICTURE, and a link out of it."""
    folder = tmp_path_factory.mktemp("media")
    (folder / "inside.png").write_bytes(PNG)
    (folder.parent / "outside.png").write_bytes(PNG)
    (folder / "link.png").symlink_to(folder.parent / "outside.png")
    return folder


@pytest.fixture(scope="module")
def serve(llava, media, tmp_path_factory):
    from tests.utils.serve import Serve
    flags = ["--allowed-media-domains", "127.0.0.1,localhost", "--allow-private-media-hosts",
             "--allowed-local-media-path", str(media), "--limit-mm-per-prompt", '{"image": 2}',
             "--max-media-bytes", str(MAX_MEDIA_BYTES), "--log-requests"]
    with Serve(llava[0], tmp_path_factory.mktemp("serve_images"), *flags, kv_cache_bytes=64 << 20, max_model_len=512,
               start_timeout=300, stop_timeout=60) as served:
        yield served


@contextlib.contextmanager
def frontend(serve, model: str, *flags: str):
    """Another frontend, with other flags, on the served Triton: an OpenAI client on it."""
    from openai_frontend.main import parse_settings
    from tests.utils.serve import API_KEY, ServedApp
    settings, _ = parse_settings(["--grpc-url", serve.grpc_url, "--model", model, "--api-key", API_KEY,
                                  "--max-model-len", "512", *flags])
    with ServedApp(settings) as app:
        yield OpenAI(base_url=f"{app.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@dataclass
class Answer:
    text: str
    logprobs: list[float]  # of each generated token: they move with the image's pixels, the text of a tiny
    prompt_tokens: int  # random model may not


@pytest.fixture(scope="module")
def offline(llava):
    """The offline engine's greedy answer to a prompt and its images."""
    from backend import LLM, SamplingParams
    llm = LLM(llava[0], dtype="float32", kv_cache_memory_bytes=64 << 20)

    def generate(prompt: str, images: list, ignore_eos: bool = True) -> Answer:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos, logprobs=0)
        request = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)[0]
        output = request.outputs[0]
        return Answer(output.text, [position[token].logprob for position, token in zip(output.logprobs,
                                                                                       output.token_ids)],
                      len(request.prompt_token_ids))
    return generate


def decoded(data: bytes):
    from PIL import Image
    return Image.open(io.BytesIO(data)).convert("RGB")


def chat(client: OpenAI, model: str, messages: list[dict], **options):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                          extra_body={"ignore_eos": True}, **options)


def served(client: OpenAI, model: str, messages: list[dict]) -> Answer:
    response = chat(client, model, messages, logprobs=True)
    choice = response.choices[0]
    return Answer(choice.message.content, [entry.logprob for entry in choice.logprobs.content],
                  response.usage.prompt_tokens)


def same(answer: Answer, expected: Answer) -> bool:
    """The same text and token count, logprobs within float32's noise (another image moves them by 1e-3)."""
    return (answer.text, answer.prompt_tokens) == (expected.text, expected.prompt_tokens) and \
        max(abs(a - b) for a, b in zip(answer.logprobs, expected.logprobs, strict=True)) < 1e-5


def refused(client: OpenAI, model: str, messages: list[dict]) -> dict:
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, model, messages)
    return error.value.body


def test_served_answers_are_the_offline_engines(client, llava, offline):
    model = Path(llava[0]).name
    for form in ("PNG", "JPEG"):  # JPEG is lossy: the offline engine gets the pixels the server decodes
        answer = served(client, model, user(data_url(PICTURE, form), text(QUESTION)))
        assert same(answer, offline(PROMPT, [decoded(encoded(PICTURE, form))]))
        assert answer.prompt_tokens > 16  # the image's 16 placeholders counted
    assert not same(answer, offline(PROMPT, [image(5, 40, 48)]))  # the image matters

    pair = [image(1, 64, 32), image(2, 32, 32)]
    prompt = "USER: <image>\n<image>\nWhich is brighter? ASSISTANT:"
    answer = served(client, model, user(data_url(pair[0]), data_url(pair[1]), text("Which is brighter?")))
    assert same(answer, offline(prompt, pair)) and not same(answer, offline(prompt, pair[::-1]))

    expected = offline(PROMPT, [PICTURE]).text
    stream = chat(client, model, user(data_url(PICTURE), text(QUESTION)), stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected

    answer = client.responses.create(model=model, temperature=0, max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PICTURE)},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert answer.output_text == offline(PROMPT, [PICTURE], ignore_eos=False).text


def test_fetched_and_local_images_are_served(client, llava, offline, image_server, media):
    model, (host, _) = Path(llava[0]).name, image_server
    expected = offline(PROMPT, [PICTURE])
    for url in (f"http://{host}/image.png", f"file://{media}/inside.png"):
        assert same(served(client, model, user(url, text(QUESTION))), expected)


def test_refusals_name_the_part(client, llava, image_server, media):
    model, (host, _) = Path(llava[0]).name, image_server
    picture = data_url(PICTURE)
    cases = [
        (user(picture, picture, picture), "messages[0].content[2]", "at most 2 images per request"),
        (user(text("Look:"), "data:image/png;base64,%%%%"), "messages[0].content[1]", "not a valid data URL"),
        (user("data:image/png;base64," + base64.b64encode(b"not an image").decode()), "messages[0].content[0]",
         "the image could not be decoded"),  # by the llm model: its INVALID_ARG, named as the part
        (user(f"http://{host}/redirect"), "messages[0].content[0]", "redirects are not followed"),
        (user(f"http://{host}/big"), "messages[0].content[0]", f"at most {MAX_MEDIA_BYTES}"),
        (user(data_url(image(3, 160, 160))), "messages[0].content[0]", f"at most {MAX_MEDIA_BYTES}"),
        (user(f"file://{media}/link.png"), "messages[0].content[0]", "outside --allowed-local-media-path"),
        (user(f"file://{media.parent}/outside.png"), "messages[0].content[0]", "outside --allowed-local-media-path"),
        ([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": picture}}]}], "messages[1].content[0]", "user messages only"),
    ]
    for messages, param, message in cases:
        body = refused(client, model, messages)
        assert body["param"] == param and body["message"].startswith(f"{param}: ") and message in body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input=[{"role": "user", "content": [
            {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": "data:image/png;base64,!"}]}])
    assert error.value.body["param"] == "input[0].content[1]"


def test_other_frontends_open_fewer_sources(serve, llava, model_path, image_server):
    model, (host, _) = Path(llava[0]).name, image_server
    with frontend(serve, llava[0]) as plain:
        assert "remote image URLs are not enabled (--allowed-media-domains)" in \
            refused(plain, model, user(f"http://{host}/image.png"))["message"]
        assert "local file image URLs are not enabled" in refused(plain, model, user("file:///tmp/a.png"))["message"]
    with frontend(serve, llava[0], "--allowed-media-domains", "127.0.0.1", "localhost") as public_only:
        assert "resolves to a private address" in refused(public_only, model, user(f"http://{host}/image.png"))["message"]
    with frontend(serve, model_path) as text_only:
        body = refused(text_only, Path(model_path).name, user(text(QUESTION), data_url(PICTURE)))
        assert body["param"] == "messages[0].content[1]" and "does not accept images" in body["message"]


def test_images_are_never_logged(serve):
    log = serve.log()
    assert "<image>" in log  # --log-requests logged the prompts, placeholders and all
    assert base64.b64encode(PNG).decode()[:48] not in log and base64.b64encode(encoded(PICTURE, "JPEG"))[:48].decode() \
        not in log
