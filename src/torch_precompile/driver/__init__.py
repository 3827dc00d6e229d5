"""The driver that every artifact carries as source: real modules, copied in only as needed.

``core`` is in every artifact. ``memo`` joins it when the computation takes a model,
``dynamic`` when dims were marked dynamic, ``distributed`` when DTensors are involved,
``subclasses`` when other tensor subclasses (quantized weights) are, and so on. Each
part imports only torch, the standard library and (for the parts) names of ``core``; the
artifact holds all of them in one namespace, so those imports are left out when copying.
"""
