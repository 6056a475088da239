// E2B's JavaScript SDKs (unmodified, from the npm registry) against airlock: the basic flows a
// JS user runs first. Run by tests/e2b/test_js_sdk.py with E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY set; exits non-zero at the first difference, naming it.
import assert from 'node:assert/strict'
import { Sandbox, CommandExitError } from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'

const step = (what) => console.log(`ok: ${what}`)

const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { suite: 'js' } })
try {
  const run = await sbx.commands.run('echo "hi $WHO" && pwd', { envs: { WHO: 'node' } })
  assert.equal(run.exitCode, 0)
  assert.equal(run.stdout, 'hi node\n/home/user\n')
  step('commands.run: stdout, envs, the user\'s home as cwd')

  await assert.rejects(sbx.commands.run('echo oops >&2; exit 3'), (e) => {
    assert.ok(e instanceof CommandExitError, `${e}`)
    assert.equal(e.exitCode, 3)
    assert.equal(e.stderr, 'oops\n')
    return true
  })
  step('commands.run: a failing command throws CommandExitError with its exit code and stderr')

  const out = []
  const bg = await sbx.commands.run('sleep 0.5; echo late', { background: true, onStdout: (d) => out.push(d) })
  const done = await bg.wait()
  assert.equal(done.exitCode, 0)
  assert.equal(out.join(''), 'late\n')
  step('commands.run in the background: onStdout, wait')

  const info = await sbx.files.write('/home/user/js/hello.txt', 'hello from node')
  assert.equal(info.path, '/home/user/js/hello.txt')
  assert.equal(await sbx.files.read('/home/user/js/hello.txt'), 'hello from node')
  const bytes = await sbx.files.read('/home/user/js/hello.txt', { format: 'bytes' })
  assert.equal(Buffer.from(bytes).toString(), 'hello from node')
  const names = (await sbx.files.list('/home/user/js')).map((e) => e.name)
  assert.deepEqual(names, ['hello.txt'])
  assert.equal(await sbx.files.exists('/home/user/js/nope'), false)
  step('files: write, read (text and bytes), list, exists')

  // A signed download URL, and one already past its time: envd's exact answer.
  const signed = await Sandbox.create({ timeoutMs: 60_000, secure: true })
  try {
    await signed.files.write('/home/user/s.txt', 'signed')
    let res = await fetch(await signed.downloadUrl('/home/user/s.txt', { useSignatureExpiration: 10_000 }))
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'signed')
    res = await fetch(await signed.downloadUrl('/home/user/s.txt', { useSignatureExpiration: -10_000 }))
    assert.equal(res.status, 401)
    assert.deepEqual(await res.json(), { code: 401, message: 'signature is already expired' })
    step('downloadUrl: signed, and expired')
  } finally {
    await signed.kill()
  }

  const listed = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()
  assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
  assert.equal(await sbx.isRunning(), true)
  step('Sandbox.list by metadata, isRunning')
} finally {
  await sbx.kill()
}
assert.equal(await sbx.isRunning(), false)
step('kill')

const ci = await CodeSandbox.create({ timeoutMs: 120_000 })
try {
  let ex = await ci.runCode('x = 6 * 7\nprint("printed")\nx')
  assert.equal(ex.text, '42')
  assert.deepEqual(ex.logs.stdout, ['printed\n'])
  ex = await ci.runCode('import os; os.environ.get("FOO")', { envs: { FOO: 'bar' } })
  assert.equal(ex.text, 'bar')
  ex = await ci.runCode('1 / 0')
  assert.equal(ex.error?.name, 'ZeroDivisionError')
  assert.match(ex.error?.traceback ?? '', /ZeroDivisionError/)
  const ctx = await ci.createCodeContext({ language: 'python' })
  ex = await ci.runCode('x', { context: ctx })
  assert.equal(ex.error?.name, 'NameError')
  step('runCode: a result, stdout, envs, an error with its traceback, a context of its own')
} finally {
  await ci.kill()
}
console.log('all ok')
