/*
 * FlashCodec's fast H.264 open for decoders that take no FFmpeg options (torchcodec).
 *
 * FFmpeg's stream-info pass (avformat_find_stream_info) decodes the first 7 or more pictures of an H.264 stream
 * in software only to guess its reorder depth: about 0.07-0.16 s per 1080p open on one core, paid by every NVDEC
 * session and every CPU thread that opens the video. Told `skip_frame=all` for that stream, the pass only parses.
 * PyAV takes that option at av.open; torchcodec calls avformat_find_stream_info(ctx, NULL) and takes none.
 *
 * Loaded RTLD_GLOBAL before torchcodec, this library's avformat_find_stream_info comes first in the process's
 * global symbol scope, so torchcodec's calls (and every other library's) reach it. A call made while its thread is
 * armed (flashcodec_fast_open_arm, by flashcodec/decode/fast_open.py around one decoder's constructor) passes
 * `skip_frame=all` for the armed stream; every other call passes through unchanged. The real function is the one
 * of the libavformat that made the context: an AVFormatContext starts with its AVClass pointer, which points into
 * that library (so a process with two FFmpeg copies, e.g. PyAV's and the system's, calls each its own).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>

typedef struct AVDictionary AVDictionary;
typedef int (*find_stream_info_fn)(void *, AVDictionary **);
typedef int (*dict_set_fn)(AVDictionary **, const char *, const char *, int);
typedef void (*dict_free_fn)(AVDictionary **);

/* the options array is sized from the probe's stream count; the spare entries (NULL) cover streams a demuxer
 * may add between the probe's open and this one */
#define SPARE_STREAMS 64

#define EXPORT __attribute__((visibility("default")))

static __thread int armed_stream = -1;
static __thread int armed_streams = 0;
static atomic_long fast_opens;

/* The next avformat_find_stream_info call in this thread skips decoding for `stream` of `streams`. */
EXPORT void flashcodec_fast_open_arm(int stream, int streams) {
  if (stream >= 0 && stream < streams) {
    armed_stream = stream;
    armed_streams = streams;
  }
}

/* 1 when this thread's arm was not used (no call reached this library): the caller says so and disarms. */
EXPORT int flashcodec_fast_open_pending(void) { return armed_stream >= 0; }

EXPORT void flashcodec_fast_open_disarm(void) { armed_stream = -1; }

/* Calls that skipped the decode, in this process. */
EXPORT long flashcodec_fast_open_count(void) { return atomic_load(&fast_opens); }

static void *owning_library(void *ic) {
  Dl_info where;
  if (ic == NULL || !dladdr(*(void *const *)ic, &where) || where.dli_fname == NULL || where.dli_fname[0] == '\0')
    return NULL;
  return dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
}

EXPORT int avformat_find_stream_info(void *ic, AVDictionary **options) {
  int stream = armed_stream, streams = armed_streams;
  armed_stream = -1;  /* one call per arm */
  void *lib = owning_library(ic);
  find_stream_info_fn real = lib ? (find_stream_info_fn)dlsym(lib, "avformat_find_stream_info") : NULL;
  if (real == NULL || real == avformat_find_stream_info)
    real = (find_stream_info_fn)dlsym(RTLD_NEXT, "avformat_find_stream_info");
  if (real == NULL) {
    if (lib) dlclose(lib);
    return -ENOSYS;  /* AVERROR(ENOSYS) */
  }
  dict_set_fn dict_set = lib ? (dict_set_fn)dlsym(lib, "av_dict_set") : NULL;  /* from its libavutil */
  dict_free_fn dict_free = lib ? (dict_free_fn)dlsym(lib, "av_dict_free") : NULL;
  int ret;
  AVDictionary **opts = NULL;
  if (stream >= 0 && options == NULL && dict_set && dict_free)
    opts = calloc((size_t)streams + SPARE_STREAMS, sizeof *opts);
  if (opts != NULL && dict_set(&opts[stream], "skip_frame", "all", 0) >= 0) {
    ret = real(ic, opts);
    atomic_fetch_add(&fast_opens, 1);
  } else {
    ret = real(ic, options);
  }
  if (opts != NULL) {
    for (int i = 0; i < streams + SPARE_STREAMS; i++) dict_free(&opts[i]);
    free(opts);
  }
  if (lib) dlclose(lib);
  return ret;
}
