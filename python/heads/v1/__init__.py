"""Generated gRPC messages and stubs of proto/heads/v1/heads.proto (heads_pb2, heads_pb2_grpc), built with the package."""
