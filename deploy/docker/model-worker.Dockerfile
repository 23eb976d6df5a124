# Image of a model worker (embedding, reranking, generation; models mounted at /models).
# Built FROM scratch (there is no registry to pull a base image from): deploy/build-images.sh
# stages a root filesystem with the stripped release binary, the shared libraries ldd lists
# for it, ragctl for the health check, a non-root user and /data, then builds this file with
# that directory as the context.
FROM scratch
COPY rootfs/ /
COPY --chown=10001:10001 data/ /data/
USER 10001:10001
WORKDIR /data
ENV RAGCLUSTER__TELEMETRY__METRICS_LISTEN=0.0.0.0:9200 \
    RAGCLUSTER__MODEL_WORKER__LISTEN=0.0.0.0:7200
EXPOSE 7200 9200
VOLUME ["/data"]
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/ragctl", "health", "http://127.0.0.1:7200"]
ENTRYPOINT ["/usr/local/bin/model-worker"]
