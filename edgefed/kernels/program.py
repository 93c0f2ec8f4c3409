"""The program a sequential model runs (kernels/network.py): one int64 row per operation, these columns.

Every layer kernel reads its own row, so the operations share two signatures (forward and backward) and
the network's dispatch is one call per operation.
"""

# operations (DENSE_STEPPED: a dense layer of dense.FUSED_WEIGHTS or more, whose backward pass steps its weights)
INPUT, DENSE, CONV, POOL, GLOBAL_POOL, ACTIVATION, DROPOUT, GROUPNORM, PERMUTE, DENSE_STEPPED = range(10)
EMBEDDING, LSTM, GRU = range(10, 13)  # sequence.py: over the whole batch, as dense layers
# columns: the operation; where its input and output start in a sample's activations and their sizes; its
# parameters (first, count) and aux values (pooling winners, dropout masks); its input map (C, H, W) and
# output map (CO, HO, WO) (a dense layer: C = d_in, CO = d_out; a 1-D map has H = 1); kernel, stride, top and
# left padding and the padded map's size; a mode (dense/conv: fused ReLU; pooling: kind; activation: kind;
# groupnorm: groups; input: permuted); whether the input's gradient is needed; where its padded map starts
# in the pads scratch, its index map in perms, and (a convolution) its packed W^T in the wt scratch; where the
# values it keeps for its backward pass start in a sample's activations (a recurrent layer's states and gates,
# sequence.py; the same region of the deltas is its backward pass's scratch); whether its parameters are
# frozen (`trainable = false`: they come after every trainable one in the vector, get no SGD step, and their
# gradient is computed only where a trainable layer below needs the input's).
#
# A sequence layer's row: C = its input features (an embedding: the vocabulary), CO = hidden units (an
# embedding: its dimension), W = the sequence's length L, H = stacked layers; mode: a recurrent layer's
# output (1: every step's, 0: the last step's), an embedding's padding_idx + 1 (0: none).
#
# Dense and sequence layers run over the whole batch; a run of other operations between them runs sample by sample
# (each sample's maps stay in cache from one operation to the next), forward and backward.
(F_TYPE, F_IN, F_OUT, F_NIN, F_NOUT, F_PARAM, F_NPARAM, F_AUX, F_C, F_H, F_W, F_CO, F_HO, F_WO, F_KH, F_KW, F_SH,
 F_SW, F_PT, F_PL, F_HP, F_WP, F_MODE, F_GRAD_IN, F_PAD, F_PERM, F_WT, F_WORK, F_FROZEN) = range(29)
WIDTH = 29
