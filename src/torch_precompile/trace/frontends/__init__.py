"""The two front-ends that read ``fn``: the ``make_fx`` run that makes the graph, and Dynamo's
reading of ``fn``'s Python (``tracer="dynamo"``), whose guards become the artifact's checks."""
