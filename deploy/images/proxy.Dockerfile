# syntax=docker/dockerfile:1
# The proxy: OpenAI API, routing, tokenizer. Slim, no torch (deploy/images/proxy-requirements.txt).
#   docker build -f deploy/images/proxy.Dockerfile -t tandem-proxy .
FROM python:3.12-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
COPY deploy/images/proxy-requirements.txt /tmp/proxy-requirements.txt
RUN pip install --no-cache-dir -r /tmp/proxy-requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kvtransfer kvtransfer
COPY protos protos
COPY wire wire
COPY settings settings
COPY node_common node_common
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY proxy proxy
COPY cluster cluster
COPY benchmark benchmark
# the package without its dependencies: the proxy's are installed above, torch never is
RUN pip install --no-cache-dir --no-deps .

FROM python:3.12-slim-bookworm
LABEL org.opencontainers.image.title="tandem-proxy" \
      org.opencontainers.image.description="Tandem's OpenAI-compatible proxy (no torch)"
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp tandem
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["python", "-m", "proxy"]
CMD ["--help"]
