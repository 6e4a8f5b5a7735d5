"""python -m proxy --prefill HOST:PORT --decode HOST:PORT --model DIR [--port 8000]"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from engine.tokenizer import load_tokenizer
from proxy.app import ProxyState, create_app
from proxy.clients import DecodeClient, PrefillClient
from proxy.pd import PDPipeline


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    parser.add_argument("--prefill", action="append", required=True, help="HOST:PORT of a prefill node")
    parser.add_argument("--decode", action="append", required=True, help="HOST:PORT of a decode node")
    parser.add_argument("--model", required=True, help="model directory (for its tokenizer)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pipeline = PDPipeline([PrefillClient(a) for a in args.prefill], [DecodeClient(a) for a in args.decode])
    state = ProxyState(pipeline, load_tokenizer(Path(args.model)), args.served_model_name or Path(args.model).name,
                       args.request_timeout)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()
