"""Images named in chat requests -> the base64 images Triton's `image` input takes, under the
operator's rules: `data:` URLs always; `http(s)` URLs only from --allowed-media-domains hosts, only
at public addresses (the connection goes to the address that was checked, so a second DNS answer
cannot point it elsewhere), without redirects, proxies, or more than --max-media-bytes within
--media-fetch-timeout; `file:` URLs only under --allowed-local-media-path. Errors name the content
part; nothing here logs or echoes an image or its URL.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import json
import os
import re
import socket
import stat
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from openai_frontend.errors import OpenAIError, invalid

# The llm model's own bounds (backend/multimodal.py: MAX_IMAGES_PER_PROMPT, MAX_IMAGE_BYTES), which
# the frontend cannot import without torch; tests/serving/test_openai_images.py keeps them equal.
DEFAULT_IMAGES_PER_PROMPT = 16
DEFAULT_MAX_MEDIA_BYTES = 20 << 20
DEFAULT_FETCH_TIMEOUT_S = 10.0
DATA_URL = re.compile(r"data:(?P<mime>[^,;]*)(?P<params>(?:;[^,;]*)*),(?P<payload>.*)", re.DOTALL)


@dataclass(frozen=True)
class ImagePart:
    """An image a request names: where (`messages[0].content[1]`, for errors) and its URL."""
    param: str
    url: str


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images, as the llm model takes it: the text, with one placeholder per image
    (the model's processor expands each into the image's tokens), and the images, base64, in order."""
    text: str
    images: list[bytes]


def images_per_prompt(value: str | dict | None) -> int:
    """vLLM's --limit-mm-per-prompt: JSON ('{"image": 2}') or its older `image=2`; None: the
    llm model's own bound. Other modalities may appear only with 0 (none are served)."""
    if value is None:
        return DEFAULT_IMAGES_PER_PROMPT
    limits = value
    if isinstance(value, str):
        try:
            limits = json.loads(value) if value.strip().startswith("{") else \
                {key.strip(): int(count) for key, _, count in (pair.partition("=") for pair in value.split(","))}
        except ValueError:
            raise ValueError(f"limit_mm_per_prompt: JSON such as '{{\"image\": 2}}', got {value!r}") from None
    if not isinstance(limits, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in limits.values()):
        raise ValueError(f"limit_mm_per_prompt: an object of modality -> count >= 0, got {value!r}")
    others = sorted(key for key, count in limits.items() if key != "image" and count)
    if others:
        raise ValueError(f"limit_mm_per_prompt: only images are served, not {', '.join(others)}")
    return limits.get("image", DEFAULT_IMAGES_PER_PROMPT)


def scheme_of(url: str) -> str:
    match = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*):", url)
    return match.group(1).lower() if match else ""


def domain_list(entries: list[str]) -> frozenset[str]:
    """--allowed-media-domains: hosts, repeated or comma-separated, compared case-insensitively."""
    return frozenset(host.strip().lower().rstrip(".") for entry in entries for host in entry.split(",")
                     if host.strip())


def public_address(address: str) -> bool:
    """Whether an IP address is on the public internet: not private, loopback, link-local, shared,
    reserved, multicast or unspecified (an IPv4 address mapped into IPv6 counts as itself)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local
                                 or ip.is_unspecified)


class TooLarge(Exception):
    pass


@dataclass(frozen=True)
class MediaPolicy:
    """The operator's rules for the images a request names (the frontend's flags of the same names)."""
    allowed_media_domains: frozenset[str] = frozenset()  # none: http(s) image URLs are refused
    allow_private_media_hosts: bool = False  # an allowed host may resolve to a private address
    allowed_local_media_path: str | None = None  # a folder's real path: file URLs under it
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S
    images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT

    @classmethod
    def from_settings(cls, settings) -> "MediaPolicy":
        root = settings.allowed_local_media_path
        return cls(domain_list(settings.allowed_media_domains), settings.allow_private_media_hosts,
                   None if root is None else os.path.realpath(root), settings.max_media_bytes,
                   settings.media_fetch_timeout, images_per_prompt(settings.limit_mm_per_prompt))

    def check(self, parts: list[ImagePart]) -> None:
        """What can be told without reading any image: how many, and whether each URL's source is open."""
        if len(parts) > self.images_per_prompt:
            extra = parts[self.images_per_prompt]
            raise invalid(extra.param, f"{extra.param}: at most {self.images_per_prompt} images per request "
                                       f"(--limit-mm-per-prompt), got {len(parts)}")
        for part in parts:
            scheme = scheme_of(part.url)
            if scheme in ("http", "https"):
                self.remote_host(part)
            elif scheme == "file":
                if self.allowed_local_media_path is None:
                    raise invalid(part.param, f"{part.param}: local file image URLs are not enabled "
                                              "(--allowed-local-media-path)")
            elif scheme != "data":
                raise invalid(part.param, f"{part.param}: image_url must be a data:, http(s): or file: URL")

    async def load(self, parts: list[ImagePart]) -> list[bytes]:
        """Each part's image as base64: all checked, then read concurrently; the first refusal
        stops the other reads."""
        self.check(parts)
        reads = [asyncio.ensure_future(self.load_one(part)) for part in parts]
        try:
            return list(await asyncio.gather(*reads))
        finally:
            for read in reads:
                read.cancel()

    async def load_one(self, part: ImagePart) -> bytes:
        scheme = scheme_of(part.url)
        if scheme == "data":
            return self.data_url(part)
        try:
            data = await (self.read_file(part) if scheme == "file" else self.fetch(part))
        except TooLarge:
            raise invalid(part.param, f"{part.param}: the image is larger than {self.max_media_bytes} bytes "
                                      "(--max-media-bytes)") from None
        return base64.b64encode(data)

    def too_large(self, part: ImagePart, size: int) -> OpenAIError:
        return invalid(part.param, f"{part.param}: the image is {size} bytes; at most {self.max_media_bytes} "
                                   "(--max-media-bytes)")

    # -- data: URLs ----------------------------------------------------------------------------
    def data_url(self, part: ImagePart) -> bytes:
        """The payload of `data:image/...;base64,...`, checked to be base64 (Triton decodes it again)."""
        match = DATA_URL.fullmatch(part.url)
        if match is None or not match.group("mime").lower().startswith("image/") \
                or match.group("params").lower().split(";")[-1] != "base64":
            raise invalid(part.param, f"{part.param}: image_url is not a valid data URL "
                                      "(data:image/<type>;base64,<data>)")
        payload = match.group("payload").encode("ascii", "replace")
        if len(payload) // 4 * 3 > self.max_media_bytes + 3:  # before decoding: the size the base64 implies
            raise self.too_large(part, len(payload) // 4 * 3)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(part.param, f"{part.param}: image_url is not a valid data URL (its base64 does not "
                                      "decode)") from None
        if not data:
            raise invalid(part.param, f"{part.param}: image_url is not a valid data URL (no data)")
        if len(data) > self.max_media_bytes:
            raise self.too_large(part, len(data))
        return payload

    # -- file: URLs ----------------------------------------------------------------------------
    async def read_file(self, part: ImagePart) -> bytes:
        """A file under --allowed-local-media-path: its real path (symlinks resolved) must be inside."""
        url = urlsplit(part.url)
        if url.netloc not in ("", "localhost"):
            raise invalid(part.param, f"{part.param}: a file URL names no host (file:///path)")
        root = self.allowed_local_media_path
        path = os.path.realpath(unquote(url.path))
        if os.path.commonpath([path, root]) != root:
            raise invalid(part.param, f"{part.param}: the file is outside --allowed-local-media-path")

        def read() -> bytes:
            # O_NOFOLLOW: the path was resolved above; a symlink put there since is refused.
            descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(descriptor, "rb") as file:
                if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                    raise IsADirectoryError(path)
                data = file.read(self.max_media_bytes + 1)
            if len(data) > self.max_media_bytes:
                raise TooLarge()
            return data

        try:
            return await asyncio.to_thread(read)
        except OSError:
            raise invalid(part.param, f"{part.param}: the file could not be read (no such file?)") from None

    # -- http(s): URLs -------------------------------------------------------------------------
    def remote_host(self, part: ImagePart) -> str:
        if not self.allowed_media_domains:
            raise invalid(part.param, f"{part.param}: remote image URLs are not enabled (--allowed-media-domains)")
        url = urlsplit(part.url)
        host = (url.hostname or "").rstrip(".")
        if url.username is not None or url.password is not None:
            raise invalid(part.param, f"{part.param}: image URLs may not carry credentials")
        if host not in self.allowed_media_domains:
            raise invalid(part.param, f"{part.param}: the host {host!r} is not in --allowed-media-domains")
        return host

    async def fetch(self, part: ImagePart) -> bytes:
        try:
            return await asyncio.wait_for(self.download(part), self.media_fetch_timeout)
        except asyncio.TimeoutError:
            raise invalid(part.param, f"{part.param}: fetching the image took over {self.media_fetch_timeout:g} s "
                                      "(--media-fetch-timeout)") from None

    async def download(self, part: ImagePart) -> bytes:
        import httpx

        host, url = self.remote_host(part), urlsplit(part.url)
        try:
            port = url.port or (443 if url.scheme.lower() == "https" else 80)
        except ValueError:
            raise invalid(part.param, f"{part.param}: image_url has an invalid port") from None
        address = await self.address_of(part, host, port)
        # To the address checked (Host header and TLS name as the URL gives them): a DNS answer that
        # changes between the check and the connection cannot send it elsewhere.
        target = f"[{address}]" if ":" in address else address
        pinned = url._replace(netloc=f"{target}:{port}").geturl()
        headers = {"Host": host if url.port is None else f"{host}:{url.port}", "Accept": "image/*"}
        try:
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                         timeout=self.media_fetch_timeout) as client:
                async with client.stream("GET", pinned, headers=headers,
                                         extensions={"sni_hostname": host}) as response:
                    if response.is_redirect or 300 <= response.status_code < 400:
                        raise invalid(part.param, f"{part.param}: the image URL redirects (HTTP "
                                                  f"{response.status_code}); redirects are not followed")
                    if response.status_code != 200:
                        raise invalid(part.param, f"{part.param}: fetching the image failed (HTTP "
                                                  f"{response.status_code})")
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > self.max_media_bytes:
                        raise self.too_large(part, int(declared))
                    data = bytearray()
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > self.max_media_bytes:
                            raise TooLarge()
                    return bytes(data)
        except httpx.HTTPError as error:  # its text holds the URL: only its kind is told
            raise invalid(part.param, f"{part.param}: the image could not be fetched ({type(error).__name__})") \
                from None

    async def address_of(self, part: ImagePart, host: str, port: int) -> str:
        """The host's first address; every address it resolves to must be public unless
        --allow-private-media-hosts (an attacker's name may resolve to several)."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise invalid(part.param, f"{part.param}: the host {host!r} does not resolve") from None
        addresses = [str(info[4][0]) for info in infos]
        if not self.allow_private_media_hosts and not all(public_address(a) for a in addresses):
            raise invalid(part.param, f"{part.param}: the host {host!r} resolves to a private address; images "
                                      "are fetched from public addresses only (--allow-private-media-hosts)")
        return addresses[0]


def name_image_error(error: OpenAIError, parts: list[ImagePart]) -> OpenAIError:
    """Triton's refusal of an image ("image 1 could not be decoded", "takes text only"), named as
    the request's content part."""
    if not parts or error.param not in ("image", "multi_modal_data"):
        return error
    message = error.message.removeprefix(f"{error.param}: ")
    match = re.match(r"image (\d+) ", message)
    part = parts[int(match.group(1))] if match and int(match.group(1)) < len(parts) else parts[0]
    if match:
        message = "the image " + message[match.end():]
    if "text only" in message:
        message = f"the model does not accept images ({message})"
    return invalid(part.param, f"{part.param}: {message}")
