# Image of the colocated binary: a coordinator with a shard node in its process (client gRPC
# and catalog Raft on 7000, the shard node's gRPC for Raft peers and other coordinators on
# 7100). Built FROM scratch like the others by deploy/build-images.sh.
FROM scratch
COPY rootfs/ /
COPY --chown=10001:10001 data/ /data/
USER 10001:10001
WORKDIR /data
ENV RAGCLUSTER__TELEMETRY__METRICS_LISTEN=0.0.0.0:9000 \
    RAGCLUSTER__COORDINATOR__LISTEN=0.0.0.0:7000 \
    RAGCLUSTER__COORDINATOR__DATA_DIR=/data/coordinator \
    RAGCLUSTER__SHARD_NODE__LISTEN=0.0.0.0:7100 \
    RAGCLUSTER__SHARD_NODE__DATA_DIR=/data/shard-node
EXPOSE 7000 7100 9000
VOLUME ["/data"]
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/ragctl", "health", "http://127.0.0.1:7000"]
ENTRYPOINT ["/usr/local/bin/colocated"]
