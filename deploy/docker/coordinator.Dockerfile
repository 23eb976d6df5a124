# Image of the coordinator (client gRPC, catalog Raft).
# Built FROM scratch (there is no registry to pull a base image from): deploy/build-images.sh
# stages a root filesystem with the stripped release binary, the shared libraries ldd lists
# for it, ragctl for the health check, a non-root user and /data, then builds this file with
# that directory as the context.
FROM scratch
COPY rootfs/ /
COPY --chown=10001:10001 data/ /data/
USER 10001:10001
WORKDIR /data
ENV RAGCLUSTER__TELEMETRY__METRICS_LISTEN=0.0.0.0:9000 \
    RAGCLUSTER__COORDINATOR__LISTEN=0.0.0.0:7000 \
    RAGCLUSTER__COORDINATOR__DATA_DIR=/data
EXPOSE 7000 9000
VOLUME ["/data"]
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/ragctl", "health", "http://127.0.0.1:7000"]
ENTRYPOINT ["/usr/local/bin/coordinator"]
