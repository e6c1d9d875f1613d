"""Generated CSI spec (csi.v1) messages and gRPC stubs; regenerate with scripts/gen-csi-proto.sh."""
