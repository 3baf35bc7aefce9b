"""The coordinator's side of its workers: the protocols the round loop sees
(``protocol``), their gRPC implementation (``grpc_client``), the replicas
of each pool and how they are found (``replicas``, ``discovery``), and a
generation's draft and target sessions with their recovery (``draft_link``,
``target_link``)."""
