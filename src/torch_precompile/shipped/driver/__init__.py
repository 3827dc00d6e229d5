"""The driver that every artifact carries as source: real modules, copied in only as needed.

``core`` is in every artifact. ``memo`` joins it when the computation takes a model,
``dynamic`` when dims were marked dynamic, ``distributed`` when DTensors are involved,
``subclasses`` when other tensor subclasses (quantized weights) are, ``planned`` beside
optimizers and subclasses, and so on. Each part imports only torch, the standard library and
names of ``core`` or of the parts before it; the artifact holds all of them in one
namespace, so those imports are left out when copying.
"""
