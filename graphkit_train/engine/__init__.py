"""What the trainers run on: resident values in alternating buffer sets
(:mod:`.resident`) and an ONNX graph's forward and backward as two calls
(:mod:`.forward_backward`), both over the chosen backend's sessions."""
