"""python -m proxy (--registry redis://HOST:PORT | --prefill HOST:PORT --decode HOST:PORT) --model DIR
[--port 8000] [--api-key KEY ...] [--api-key-file FILE] [--routing prefix_load|round_robin]
[--block-size N --hash-seed S] [--config FILE] [--max-request-body-bytes N] [--tokenizer-threads N]
[--max-retries N] [--health-check-interval S] [--health-check-timeout S]
[--prefill-attempt-timeout S] [--decode-first-token-timeout S] [--max-n N] [--max-logprobs N] [--max-tokens-limit N]
[--node-tls-ca FILE [--node-tls-cert FILE --node-tls-key FILE] [--node-tls-server-name NAME]]
[--otlp-traces-endpoint URL]"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from engine.tokenizer import load_tokenizer
from node_common.tls import ChannelSecurity, TLSFileError
from node_common.tracing import make_tracer
from proxy.api.app import ProxyState, create_app, read_max_model_len
from proxy.api.auth import load_api_keys
from proxy.api.limits import add_limit_args, limits_from_args
from proxy.api.request_body import DEFAULT_MAX_REQUEST_BODY_BYTES
from proxy.api.serving import DEFAULT_TOKENIZER_THREADS
from proxy.routing.pd import add_routing_args, pipeline_from_args
from settings import TREE_KEYS, ConfigError, HashingSettings, add_arguments, parse_args_with, resolve
from settings import env as environment
from settings.chat import ChatSettings
from settings.cluster import TracingSettings
from settings.tls import ClientTLSSettings


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    add_routing_args(parser)  # --prefill/--decode/--registry, --routing
    # the cluster's prefix hashing, declared with the nodes' (settings.cluster): the prefix index hashes as they do
    add_arguments(parser, HashingSettings)
    add_arguments(parser, ClientTLSSettings, config_flag=False)  # TLS to the nodes, declared with the nodes' own
    add_arguments(parser, ChatSettings, config_flag=False)  # tool-call and reasoning parsers, as tandem serve's
    add_arguments(parser, TracingSettings, config_flag=False)  # --otlp-traces-endpoint, as the nodes'
    parser.add_argument("--model", required=True, help="model directory (for its tokenizer and context length)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="clients must send 'Authorization: Bearer KEY'; give it again for more keys (default: "
                             "$TANDEM_API_KEY; none: open). /health and /metrics stay open")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="more keys, one a line (# comments and blank lines skipped); keeps keys off the "
                             "command line")
    parser.add_argument("--metrics-require-api-key", action="store_true",
                        help="/metrics needs an API key too (default: open, as vLLM's, for scrapers without one; it "
                             "names the nodes)")
    add_limit_args(parser)  # --max-n, --max-logprobs, --max-tokens-limit
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + max_tokens limit (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-requests", type=int, default=None,
                        help="choices in flight at this proxy before it answers 429 (default: no limit)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 before they are read (default: 32 MiB)")
    parser.add_argument("--tokenizer-threads", type=int, default=DEFAULT_TOKENIZER_THREADS,
                        help="threads that decode and tokenize request bodies, off the event loop")
    parser.add_argument("--log-level", default="info")
    args, hashing = parse_args_with(parser, HashingSettings, argv)
    if args.max_request_body_bytes <= 0 or args.tokenizer_threads <= 0:
        parser.error("--max-request-body-bytes and --tokenizer-threads must be positive")
    args.hashing = hashing
    args.limits = limits_from_args(parser, args)
    try:
        args.node_security = ChannelSecurity.from_settings(
            resolve(ClientTLSSettings, vars(args), environment.settings_layer(), TREE_KEYS))
    except (ConfigError, TLSFileError) as e:
        parser.error(str(e))
    try:
        args.chat = resolve(ChatSettings, vars(args), environment.settings_layer(), TREE_KEYS)
        args.tracing = resolve(TracingSettings, vars(args), environment.settings_layer(), TREE_KEYS)
    except ConfigError as e:
        parser.error(str(e))
    try:
        args.api_keys = load_api_keys(args.api_key, args.api_key_file, environment.api_key())
    except ValueError as e:
        parser.error(str(e))
    return parser, args


def main() -> None:
    parser, args = parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = Path(args.model)
    tracer = make_tracer(args.tracing.otlp_traces_endpoint, "tandem-proxy")
    pipeline = pipeline_from_args(parser, args, args.node_security, tracer)
    default_name = model.stem if model.suffix == ".gguf" else model.name
    state = ProxyState(pipeline, load_tokenizer(model), args.served_model_name or default_name, args.request_timeout,
                       max_model_len=read_max_model_len(model, args.max_model_len), api_keys=args.api_keys,
                       max_num_requests=args.max_num_requests, max_request_body_bytes=args.max_request_body_bytes,
                       tokenizer_threads=args.tokenizer_threads, limits=args.limits,
                       metrics_need_key=args.metrics_require_api_key, chat=args.chat)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level.lower())
    tracer.shutdown()  # the spans still buffered go out


if __name__ == "__main__":
    main()
