// quantize.h — a model directory written again with smaller weights (`heads quantize`).
//
//   int8  each linear layer's weight of a BERT encoder (attention.self.{query,key,value},
//         attention.output.dense, intermediate.dense, output.dense under encoder.layer.<i>.) as
//         "<name>" I8 [out, in] with "<name>_scale" F32 [out], weight ≈ int8 · scale per row, and
//         for the rows that lose most (kInt8ResidualError) the residual term's "<name>_residual", "<name>_residual_scale" and
//         "<name>_residual_rows", the outlier channels' "<name>_outlier_channels" and
//         "<name>_outlier_weight", and "<name>_activation_error" (heads::int8_tensors): the int8 weights
//         BertModel::set_precision(Int8) makes (calibrated on random tokens, the activations' outlier
//         channels in f32; symmetric per output channel, the scale of least squared error). Embeddings, LayerNorm and biases stay as stored. Loaded
//         (BertModel, SentenceEncoder, `heads embed`), the model runs in int8 with these weights
//         as they are: the same numbers as quantizing the original at load time, bit for bit.
//   bf16, f16  every floating tensor of every safetensors file rounded to that type (to nearest
//         even); any model directory. Loaded, the weights are widened to f32 exactly, and the model
//         runs in the precision it is asked for (f32, or bf16 / int8 from those f32 values).
// The directory's other files (configuration, tokenizer, sentence-transformers settings) are copied;
// weights in other formats (pytorch_model.bin, onnx/, ...) are not. The output appears whole or not
// at all: it is written under a temporary name and renamed at the end.
#pragma once

#include <cstdint>
#include <string>

namespace heads {

enum class StorageDtype { Int8, BF16, F16 };

std::string storage_dtype_name(StorageDtype d);                // "int8", "bf16", "f16"
StorageDtype storage_dtype_from_name(const std::string& name);  // errors name the choices

struct QuantizeResult {
  int64_t tensors = 0;     // tensors written
  int64_t converted = 0;   // of which stored in the new type (int8: the linear weights)
  uint64_t bytes_in = 0;   // safetensors bytes read
  uint64_t bytes_out = 0;  // safetensors bytes written
};

// Writes `out_dir` (absent or empty; not inside `model_dir`) from `model_dir`. Errors name the
// directory, file or tensor: no safetensors weights, weights already int8, int8 for a model
// without BERT linear weights, a value past f16's range, a weight that cannot be quantized.
QuantizeResult quantize_model_dir(const std::string& model_dir, const std::string& out_dir, StorageDtype dtype);

}  // namespace heads
