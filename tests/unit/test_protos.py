"""The committed gRPC stubs are what the .proto files generate (run `make protos` after editing them)."""

from __future__ import annotations

from pathlib import Path

from protos.generate import PROTO_DIR, generate


def test_generated_stubs_match_the_proto_files(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "no .proto files found"
    stale = [p.name for p in fresh if (PROTO_DIR / p.name).read_text() != p.read_text()]
    assert stale == [], f"stubs out of date, run `make protos`: {stale}"


def test_stubs_import_as_a_package() -> None:
    from protos import tandem_pb2, tandem_pb2_grpc

    ticket = tandem_pb2.KVTicket(ticket_id="t", block_ids=[3, 1, 2])
    assert tandem_pb2.KVTicket.FromString(ticket.SerializeToString()).block_ids == [3, 1, 2]
    assert hasattr(tandem_pb2_grpc, "PrefillServiceStub") and hasattr(tandem_pb2_grpc, "DecodeServiceStub")
