// The callback streams' messages as bytes: requests parsed here, where a request that is no message can be told from
// the client's half-close (gRPC's own parse reports both alike, as the end of the requests), responses serialized here.
#pragma once

#include <climits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"  // (SerializationTraits of protobuf messages; gRPC 1.51's path)
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace perception::server {

// What ParseRequest and MergeRequest answer where a read's bytes are not one Message.
template <typename Message>
absl::Status NotOneMessageError() {
  return absl::InvalidArgumentError(
      absl::StrCat("a request could not be parsed as ", Message::descriptor()->full_name(),
                   " (a string field that is not UTF-8, or bytes that are no such message); nothing of it or after it "
                   "was taken"));
}

// Parses a read's `bytes` (consumed) into `message`; INVALID_ARGUMENT where they are not one of its type.
template <typename Message>
absl::Status ParseRequest(grpc::ByteBuffer& bytes, Message& message) {
  if (grpc::SerializationTraits<Message>::Deserialize(&bytes, &message).ok()) return absl::OkStatus();
  return NotOneMessageError<Message>();
}

// As ParseRequest, but merged into what `message` holds, as protobuf merges (ParseRequest clears it first): a caller
// that cleared a submessage itself keeps it, and with it the capacity of its repeated fields.
template <typename Message>
absl::Status MergeRequest(grpc::ByteBuffer& bytes, Message& message) {
  const size_t length = bytes.Length();
  bool merged = false;
  {
    grpc::ProtoBufferReader reader(&bytes);
    merged = reader.status().ok() && length <= static_cast<size_t>(INT_MAX) &&
             message.MergeFromBoundedZeroCopyStream(&reader, static_cast<int>(length));
  }
  bytes.Clear();
  return merged ? absl::OkStatus() : NotOneMessageError<Message>();
}

// `message` serialized into `bytes` (what they held before, an earlier write's, released), for a write.
template <typename Message>
void SerializeResponse(const Message& message, grpc::ByteBuffer& bytes) {
  bytes.Clear();
  bool own_buffer = false;
  // (It fails only for a message over protobuf's 2 GB, which no response here comes near.)
  grpc::SerializationTraits<Message>::Serialize(message, &bytes, &own_buffer).IgnoreError();
}

}  // namespace perception::server
