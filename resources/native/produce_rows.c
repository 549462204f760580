/*
 * rowrelay: produce a run of rows from Arrow binary columns through librdkafka, one rd_kafka_producev() call per
 * row and no Python object per row (see resources/arrow_produce.py, which loads this library with ctypes).
 *
 * Every message gets the two headers of rowrelay's message contract: rowrelay.table (the same for every row) and
 * rowrelay.watermark (the row's watermark as text). Messages are copied (RD_KAFKA_MSG_F_COPY), go to the
 * partition the caller names (the loop serves one-partition topics: no per-row partitioner, which hashed each key
 * to find partition 0) and carry no per-message opaque, so they have no delivery callback: the caller produces
 * the rows that must report their offsets through confluent-kafka. Each message's CreateTime is the wall clock,
 * read once every TIMESTAMP_ROWS rows rather than by librdkafka once per row (a gettimeofday per message was ~2 %
 * of a publishing process's samples); a run of that many rows takes about a millisecond to produce.
 *
 * Built by `make install` (cc -O2 -shared -fPIC); it needs no librdkafka headers: the caller passes the address of
 * rd_kafka_producev from the librdkafka that confluent-kafka loaded, and the argument tags below are rdkafka.h's
 * rd_kafka_vtype_t (stable since librdkafka 0.11.4).
 */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

typedef int (*producev_fn)(void *rk, ...);

enum {
    VTYPE_END = 0,
    VTYPE_RKT = 2,
    VTYPE_PARTITION = 3,
    VTYPE_VALUE = 4,
    VTYPE_KEY = 5,
    VTYPE_MSGFLAGS = 7,
    VTYPE_TIMESTAMP = 8,
    VTYPE_HEADER = 9,
};
#define MSG_F_COPY 0x2
#define TIMESTAMP_ROWS 1024

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The calling convention of produce_rows below; resources/arrow_produce.py refuses a library built from another
 * version of this file (a stale build left by a failed compile), whose arguments would not line up. */
int produce_rows_abi(void) { return 2; }

/* One Arrow binary column: its 32-bit offsets from the array's first row, its data, and its validity bitmap
 * (NULL: no nulls) with the bit of the array's first row. */
typedef struct {
    const int32_t *offsets;
    const uint8_t *data;
    const uint8_t *validity;
    int64_t bit_offset;
} binary_column;

static int is_valid(const binary_column *c, int64_t i) {
    int64_t bit = c->bit_offset + i;
    return c->validity == NULL || ((c->validity[bit >> 3] >> (bit & 7)) & 1);
}

/*
 * Produces rows [start, stop) to partition `partition` of rkt. Returns how many were produced; when fewer than
 * stop - start, *error is librdkafka's error for the next row (that row was not produced;
 * RD_KAFKA_RESP_ERR__QUEUE_FULL: wait and produce it again), else 0. A null key is produced without a key; values
 * and watermark texts have no nulls.
 */
int64_t produce_rows(producev_fn producev, void *rk, void *rkt, int32_t partition, const binary_column *keys,
                     const binary_column *values, const binary_column *watermarks, const char *table,
                     int64_t table_len, int64_t start, int64_t stop, int *error) {
    int64_t timestamp = 0;
    for (int64_t i = start; i < stop; i++) {
        if ((i - start) % TIMESTAMP_ROWS == 0)
            timestamp = now_ms();
        const uint8_t *key = NULL;
        size_t key_len = 0;
        if (keys->data != NULL && is_valid(keys, i)) {
            key = keys->data + keys->offsets[i];
            key_len = (size_t)(keys->offsets[i + 1] - keys->offsets[i]);
        }
        int err = producev(rk, VTYPE_RKT, rkt, VTYPE_PARTITION, partition,
                           VTYPE_VALUE, (void *)(values->data + values->offsets[i]),
                           (size_t)(values->offsets[i + 1] - values->offsets[i]),
                           VTYPE_KEY, (const void *)key, key_len,
                           VTYPE_MSGFLAGS, MSG_F_COPY,
                           VTYPE_TIMESTAMP, timestamp,
                           VTYPE_HEADER, "rowrelay.table", (const void *)table, (ssize_t)table_len,
                           VTYPE_HEADER, "rowrelay.watermark",
                           (const void *)(watermarks->data + watermarks->offsets[i]),
                           (ssize_t)(watermarks->offsets[i + 1] - watermarks->offsets[i]),
                           VTYPE_END);
        if (err != 0) {
            *error = err;
            return i - start;
        }
    }
    *error = 0;
    return stop - start;
}
