# tritonllm on NVIDIA's Triton image: the image's tritonserver and Python backend run our model
# repository; `tritonllm serve` is the entrypoint.
#
#   docker build -t tritonllm .
#   docker run --gpus all --shm-size=1g -p 8000-8002:8000-8002 -p 9000:9000 tritonllm
#   docker run --gpus all --shm-size=1g -p 9000:9000 -v /models:/models tritonllm --model /models/my-llama
#
# Arguments after the image name are `tritonllm serve` flags (see docs/triton.md).
ARG TRITON_VERSION=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

WORKDIR /opt/tritonllm
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY openai_frontend ./openai_frontend
COPY tools ./tools
COPY model_repository ./model_repository

# Into the image's own Python: the one its Python backend stub embeds. Editable, so `serve` finds
# model_repository/ beside the code. The default models are baked in so the image runs offline.
RUN pip install --no-cache-dir -e . \
 && python3 -m tools.prepare_model \
 && python3 -c "from tools.prepare_embeddings import prepare_embeddings; prepare_embeddings()"

# Triton HTTP, gRPC, metrics; the OpenAI frontend.
EXPOSE 8000 8001 8002 9000
ENTRYPOINT ["tritonllm", "serve", "--host", "0.0.0.0"]
