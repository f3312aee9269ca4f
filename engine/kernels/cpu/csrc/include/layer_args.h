// How `decode_layer` and `decode_layers` take a layer's tensors: six weights and four biases a
// layer, in this order (`decode_layer.cpp`, and the stack in one region, `decode_stack.cpp`).
#pragma once

namespace conveyor {

enum Weight { kInputNorm, kQkv, kOut, kPostNorm, kGateUp, kDown, kWeights };
enum Bias { kQkvBias, kOutBias, kGateUpBias, kDownBias, kBiases };

}  // namespace conveyor
