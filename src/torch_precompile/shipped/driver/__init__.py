"""The driver that every artifact carries as source: real modules, copied in only as needed.

``tensor_rules`` (the rules a call is checked by) is in every artifact. A plain artifact adds
``rechecks``, ``encoded`` and ``plain``, the runtime its generated checks call; any other adds
``core`` (the generic ``Driver``), with ``memo`` when the computation takes a model,
``dynamic`` when dims were marked dynamic, ``distributed`` when DTensors are involved,
``subclasses`` when other tensor subclasses (quantized weights) are, ``planned`` beside
optimizers and subclasses, and so on. Each part imports only torch, the standard library and
names of the parts before it; the artifact holds all of them in one namespace, so those
imports are left out when copying.
"""
