"""The cost model, in one room: what a layer's ops cost on a device (`kernels`, `layer`, `collectives`), what
Megatron-Core's overlaps leave of each collective (`tp_overlap`, `dp_overlap`), the work outside the layers
(`edges`, `runtime`), the price list every solver and the simulator read (`pricing`), and memory: static
(`static_memory`), activations per policy (`memory`) and their lifetimes during backward (`lifetime`);
`stage` charges one pipeline stage. No torch, and nothing here imports the solvers, the simulator or the
layers above them (docs/architecture.md)."""
