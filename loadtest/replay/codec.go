package replay

import (
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// frame is a request already in protobuf wire format.
type frame []byte

// rawCodec sends frames as they are and everything else (the acks it
// receives) with gRPC's protobuf codec. Its name is "proto", so the server
// sees the content type of any protobuf client.
type rawCodec struct{ proto encoding.CodecV2 }

func newRawCodec() rawCodec { return rawCodec{proto: encoding.GetCodecV2(protocodec.Name)} }

func (c rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(frame); ok {
		return mem.BufferSlice{mem.SliceBuffer(f)}, nil
	}
	return c.proto.Marshal(v)
}

func (c rawCodec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

func (rawCodec) Name() string { return protocodec.Name }
