# tritonllm on NVIDIA's Triton image: the image's tritonserver and Python backend run our model
# repository; `tritonllm serve` is the entrypoint.
#
#   docker build -t tritonllm .
#   docker run --gpus all --shm-size=1g --restart=on-failure -p 9000:9000 \
#       -v "$PWD/key:/run/secrets/key:ro" tritonllm --api-key-file /run/secrets/key
#   docker run ... -v /models:/models tritonllm --model /models/my-llama --api-key-file ...
#
# Arguments after the image name are `tritonllm serve` flags (see docs/triton.md). The OpenAI
# frontend is the one public door (port 9000); Triton's own ports listen inside the container only
# (add `--triton-host 0.0.0.0 -p 8000-8002:8000-8002` to publish them, on a trusted network only).
# Everything runs as the unprivileged user `tritonllm`. docs/security.md has the rest.
ARG TRITON_VERSION=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

ENV TRITONLLM_CACHE=/opt/tritonllm/cache
WORKDIR /opt/tritonllm
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY openai_frontend ./openai_frontend
COPY tools ./tools
COPY model_repository ./model_repository

# Into the image's own Python: the one its Python backend stub embeds. Editable, so `serve` finds
# model_repository/ beside the code. The default models are baked in so the image runs offline.
# The code stays root's (read-only to the service); only the cache (the CPU ops are built there on
# first use) belongs to the service's user.
RUN pip install --no-cache-dir -e . \
 && python3 -m tools.prepare_model \
 && python3 -c "from tools.prepare_embeddings import prepare_embeddings; prepare_embeddings()" \
 && useradd --create-home --uid 10001 tritonllm \
 && chown -R tritonllm "$TRITONLLM_CACHE"
USER tritonllm

# The OpenAI frontend. (Triton's 8000-8002 stay on the container's loopback unless --triton-host.)
EXPOSE 9000
# Set the API key with --api-key-file (a mounted secret) or -e TRITONLLM_API_KEY; without one the
# frontend answers anyone who reaches port 9000, and serve says so at start.
ENTRYPOINT ["tritonllm", "serve", "--host", "0.0.0.0"]
