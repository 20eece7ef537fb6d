// Request checks that need no server state (see request_validation.h).
#include "server/request_validation.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor.h"
#include "wire/wire.h"

namespace moe::server {

absl::Status ValidateLayerName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must be 1 to 128 characters"));
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": \"", name, "\" may contain only letters, digits, '.', '_', '-'"));
    }
  }
  return absl::OkStatus();
}

int64_t ResponseChunkBytes(int64_t requested) {
  if (requested <= 0) return kDefaultResponseChunkBytes;
  return std::max(requested, kMinResponseChunkBytes);
}

int64_t ExportChunkBytes(int64_t requested, int64_t max_message_bytes) {
  return std::max(requested > 0 ? requested : max_message_bytes / 2, kMinResponseChunkBytes);
}

absl::Status ValidateStripe(const v1::Stripe& stripe, uint64_t context_id) {
  if (stripe.count() < 2 || stripe.count() > wire::kMaxStripes) {
    return absl::InvalidArgumentError(absl::StrCat("stripe.count: must be 2 to ", wire::kMaxStripes,
                                                   " (0: not striped), got ", stripe.count()));
  }
  if (stripe.index() >= stripe.count()) {
    return absl::InvalidArgumentError(absl::StrCat("stripe.index: ", stripe.index(),
                                                   " is not below stripe.count ", stripe.count()));
  }
  if (stripe.total_rows() < 1 || stripe.total_rows() > kMaxTensorBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.total_rows: must be in [1, 2^40], got ", stripe.total_rows()));
  }
  if (stripe.row_begin() < 0 || stripe.row_begin() > stripe.total_rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.row_begin: ", stripe.row_begin(),
                     " is outside [0, stripe.total_rows = ", stripe.total_rows(), "]"));
  }
  if (context_id == 0) {
    return absl::InvalidArgumentError(
        "context_id: a striped micro-batch needs a nonzero context_id, which joins its streams");
  }
  return absl::OkStatus();
}

absl::Status ValidateWeightChunk(const v1::WeightChunk& chunk, absl::string_view layer) {
  if (layer.empty()) {
    MOE_RETURN_IF_ERROR(ValidateImportStream(chunk.layer()));
  } else if (!chunk.layer().empty() && chunk.layer() != layer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: \"", chunk.layer(), "\" differs from the first message's \"", layer, "\""));
  }
  if (chunk.name().empty()) {
    return absl::InvalidArgumentError("name: every WeightChunk must name its tensor");
  }
  return absl::OkStatus();
}

absl::Status ValidateImportStream(absl::string_view layer) {
  if (layer.empty()) return absl::InvalidArgumentError("layer: required on the first message");
  return absl::OkStatus();
}

}  // namespace moe::server
