package fleet

import (
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers "proto"
	"google.golang.org/grpc/mem"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// offStackDecodeBytes is the size above which a node message is decoded
// off the receiving goroutine's stack: a heartbeat is a few bytes, a
// status report a few hundred.
const offStackDecodeBytes = 64

// codec is gRPC's protobuf codec, except that it decodes a node message of
// more than offStackDecodeBytes on a fresh goroutine. A session's receiver
// spends its life in Recv, and the runtime keeps a goroutine's stack at
// the largest size it needed unless it later uses less than a quarter of
// it: decoding a status report (nested repeated messages) in place grows
// the receiver's stack from 4 to 8 KiB for the session's lifetime, 4 KiB
// per session that this keeps (measured by BenchmarkSessions). Everything
// else, including other services on the same gRPC server, is decoded and
// encoded exactly as by the default codec.
type codec struct{ encoding.CodecV2 }

func newCodec() codec { return codec{encoding.GetCodecV2("proto")} }

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if _, ok := v.(*fleetpb.NodeMessage); ok && data.Len() > offStackDecodeBytes {
		return offStack(func() error { return c.CodecV2.Unmarshal(data, v) })
	}
	return c.CodecV2.Unmarshal(data, v)
}
