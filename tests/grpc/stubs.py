"""grpcio call objects for the project's services, built from the generated messages (no grpcio codegen:
the committed modules are protoc + grpclib only, and grpcio's generated stubs pin a grpcio version)."""

from __future__ import annotations

import grpc
from grpclib.health.v1 import health_pb2

from proxy.protos import admin_pb2, generate_pb2 as gen, kserve_v2_pb2 as kv2

G = "/affinity.v1.Generation/"
K = "/inference.GRPCInferenceService/"
A = "/affinity.admin.v1.ProxyAdmin/"


def _uu(ch: grpc.aio.Channel, path: str, req: type, resp: type) -> grpc.aio.UnaryUnaryMultiCallable:
    return ch.unary_unary(path, request_serializer=req.SerializeToString, response_deserializer=resp.FromString)


def generate(ch: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    return _uu(ch, G + "Generate", gen.GenerateRequest, gen.GenerateResponse)


def generate_stream(ch: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    return ch.unary_stream(G + "GenerateStream", request_serializer=gen.GenerateRequest.SerializeToString,
                           response_deserializer=gen.GenerateResponse.FromString)


def generate_bidi(ch: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    return ch.stream_stream(G + "GenerateBidi", request_serializer=gen.GenerateRequest.SerializeToString,
                            response_deserializer=gen.GenerateResponse.FromString)


def model_infer(ch: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    return _uu(ch, K + "ModelInfer", kv2.ModelInferRequest, kv2.ModelInferResponse)


def model_stream_infer(ch: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    return ch.stream_stream(K + "ModelStreamInfer", request_serializer=kv2.ModelInferRequest.SerializeToString,
                            response_deserializer=kv2.ModelStreamInferResponse.FromString)


def health_check(ch: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    return _uu(ch, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)


def admin(ch: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    req, resp = {
        "ListBackends": (admin_pb2.ListBackendsRequest, admin_pb2.ListBackendsResponse),
        "GetBackend": (admin_pb2.GetBackendRequest, admin_pb2.BackendStatus),
        "SetWeight": (admin_pb2.SetWeightRequest, admin_pb2.BackendStatus),
        "Drain": (admin_pb2.DrainRequest, admin_pb2.BackendStatus),
    }[method]
    return _uu(ch, A + method, req, resp)
